//! The KV event publisher: a ZeroMQ PUB socket for the live stream and a ROUTER socket that
//! replays recent batches, with vLLM's framing and replay protocol (>= 0.26 layout).
//!
//! The engine assigns each batch its `seq` while it holds the cache lock (so a snapshot can
//! say which seq it is consistent with) and hands batches over a bounded channel, in order.
//! One task encodes and publishes them and appends `(seq, payload)` to a ring buffer of the
//! last `buffer_steps` batches; a second task answers replay requests `[b"", start_seq]` from
//! that buffer with one `[b"", topic, seq, payload]` message per batch and the end marker
//! `[b"", b"", ff*8, b""]`. A request older than the buffer gets what is buffered; the
//! consumer sees the first replayed seq is past what it asked for and resyncs.
//!
//! `zeromq` 0.7's PUB keeps an unbounded queue per subscriber (shared/reference/crates.md
//! §1.4): the bounded channel in front of it is this process's only backpressure. Its ROUTER
//! queues up to 100 000 messages a peer and then waits for room; a replay peer whose queue
//! stays full (it asks and does not read) has the rest of its answer dropped, as libzmq's
//! ROUTER drops past its high-water mark, so that it does not hold up the answers to others.

mod format;

pub use format::EventFormat;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvroute_proto::Seq;
use kvroute_proto::framing;
use kvroute_proto::pb::EventBatch;
use kvroute_proto::zmtp_guard::{BOUND_PEER_BUDGET, OnRefused, ZmtpGuard};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use zeromq::prelude::*;
use zeromq::{PubSocket, RouterSocket, ZmqMessage};

/// How the publisher is set up.
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// Frame 0 of every live message.
    pub topic: String,
    pub format: EventFormat,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
    /// Batches the engine may hand over before it waits for the publisher.
    pub queue: usize,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self { topic: "kv-events".into(), format: EventFormat::Kvroute, buffer_steps: 10_000, queue: 1024 }
    }
}

/// Where the sockets ended up (port 0 resolved).
#[derive(Clone, Debug)]
pub struct PublisherEndpoints {
    pub events: String,
    pub replay: Option<String>,
}

/// The engine's side of the publisher: hands over finished batches in seq order.
#[derive(Clone)]
pub struct Publisher {
    tx: mpsc::Sender<EventBatch>,
    refused: Arc<AtomicU64>,
}

/// Errors setting up the sockets.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    #[error("cannot bind {what} socket on {endpoint}")]
    Bind {
        what: &'static str,
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
    #[error("data-parallel rank {rank} has no endpoint after {endpoint} (port + rank past 65535)")]
    Rank { rank: u32, endpoint: String },
    #[error("cannot listen for {what} peers on {endpoint}")]
    Guard {
        what: &'static str,
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
}

/// How many times [`Publisher::bind_ranks`] picks rank 0's port again.
const RANK_PORT_ATTEMPTS: u32 = 20;

/// Closes a socket's guard, so that its port is free once the publisher's tasks are done.
async fn close(guard: Option<ZmtpGuard>) {
    if let Some(guard) = guard {
        guard.close().await;
    }
}

/// Binds `socket` where its peers reach it through a ZMTP guard listening on `endpoint`
/// (`zeromq` alone would let a peer announcing a huge frame abort the agent): the socket on
/// a loopback port, the guard on `endpoint`. Endpoints other than `tcp://` are bound
/// directly. Returns where peers connect (port 0 resolved) and the guard to keep.
async fn bind_guarded(
    socket: &mut impl Socket,
    endpoint: &str,
    (what, budget): (&'static str, u64),
    on_refused: &OnRefused,
) -> Result<(String, Option<ZmtpGuard>), PublisherError> {
    let bind = async |socket: &mut _, at: &str| {
        Socket::bind(socket, at).await.map(|bound| bound.to_string()).map_err(|source| PublisherError::Bind {
            what,
            endpoint: at.to_owned(),
            source,
        })
    };
    if !endpoint.starts_with("tcp://") {
        return Ok((bind(socket, endpoint).await?, None));
    }
    let internal = bind(socket, "tcp://127.0.0.1:0").await?;
    let guard = ZmtpGuard::binding_with_budget(endpoint, &internal, budget, on_refused.clone())
        .await
        .map_err(|source| PublisherError::Guard { what, endpoint: endpoint.to_owned(), source })?;
    Ok((guard.endpoint().to_owned(), Some(guard)))
}

/// Recent batches kept for replay: `(seq, payload)`, oldest first.
type RingBuffer = Arc<Mutex<VecDeque<(Seq, Bytes)>>>;

impl Publisher {
    /// A publisher on a loopback port of its own, without replay, with the default settings:
    /// for an engine run on its own (tests, the load generator's checks of its model).
    pub async fn on_loopback(tracker: &TaskTracker) -> Result<Publisher, PublisherError> {
        let bound = Self::bind(PublisherConfig::default(), "tcp://127.0.0.1:0", None, tracker);
        Ok(bound.await?.0)
    }

    /// Binds the PUB socket (and the replay ROUTER if `replay_endpoint` is given) and spawns
    /// the publishing and replay tasks on `tracker`. They run until the publisher is dropped
    /// (the engine's scheduler drops it when it ends, after its shutdown grace): the events of
    /// what the engine still runs in the grace go out, and can be replayed.
    pub async fn bind(
        config: PublisherConfig,
        events_endpoint: &str,
        replay_endpoint: Option<&str>,
        tracker: &TaskTracker,
    ) -> Result<(Publisher, PublisherEndpoints), PublisherError> {
        // Fires when the publishing task ends: the replay socket closes with it.
        let published = CancellationToken::new();
        let refused = Arc::new(AtomicU64::new(0));
        let on_refused: OnRefused = {
            let refused = refused.clone();
            Arc::new(move || {
                refused.fetch_add(1, Ordering::Relaxed);
            })
        };
        let mut pub_socket = PubSocket::new();
        let (events, events_guard) =
            bind_guarded(&mut pub_socket, events_endpoint, ("PUB", BOUND_PEER_BUDGET), &on_refused).await?;
        let buffer: RingBuffer = Arc::new(Mutex::new(VecDeque::with_capacity(config.buffer_steps.min(4096))));
        let topic = Bytes::from(config.topic.clone().into_bytes());
        let mut replay = None;
        if let Some(endpoint) = replay_endpoint {
            let mut router = RouterSocket::new();
            // A replay client may ask again and again on one connection (the socket keeps no
            // state of its requests; the answers queued for it are bounded, 100 000 messages).
            let (bound, guard) =
                bind_guarded(&mut router, endpoint, ("ROUTER", u64::MAX), &on_refused).await?;
            replay = Some(bound);
            let (topic, buffer, published) = (topic.clone(), buffer.clone(), published.clone());
            tracker.spawn(async move {
                serve_replay(router, topic, buffer, published).await;
                close(guard).await;
            });
        }
        let (tx, rx) = mpsc::channel(config.queue.max(1));
        tracker.spawn(async move {
            publish_loop(pub_socket, rx, config, topic, buffer).await;
            published.cancel();
            close(events_guard).await;
        });
        Ok((Publisher { tx, refused }, PublisherEndpoints { events, replay }))
    }

    /// A publisher for each of `ranks` data-parallel ranks, rank r on the endpoints' port + r
    /// (`ipc://x_dp{r}`), as vLLM lays them out. With port 0 (both endpoints') the system picks
    /// rank 0's ports and the others follow them; when one of those is taken, it starts over
    /// with others (a few times).
    pub async fn bind_ranks(
        config: &PublisherConfig,
        events_endpoint: &str,
        replay_endpoint: Option<&str>,
        ranks: u32,
        tracker: &TaskTracker,
    ) -> Result<Vec<(Publisher, PublisherEndpoints)>, PublisherError> {
        // Only when no port is fixed: a fixed one bound again at once could still be the last
        // attempt's, closing.
        let picked = |endpoint: &str| endpoint.starts_with("tcp://") && endpoint.ends_with(":0");
        let may_retry = picked(events_endpoint) && replay_endpoint.is_none_or(picked);
        let mut attempt = 0;
        'again: loop {
            attempt += 1;
            let first = Self::bind(config.clone(), events_endpoint, replay_endpoint, tracker).await?;
            let base = first.1.clone();
            let mut bound = vec![first];
            for rank in 1..ranks {
                let unplaced = |endpoint: &str| PublisherError::Rank { rank, endpoint: endpoint.to_owned() };
                let at =
                    |endpoint: &str| framing::rank_endpoint(endpoint, rank).ok_or_else(|| unplaced(endpoint));
                let bound_rank = async {
                    let events = at(&base.events)?;
                    let replay = base.replay.as_deref().map(at).transpose()?;
                    Self::bind(config.clone(), &events, replay.as_deref(), tracker).await
                };
                match bound_rank.await {
                    Ok(publisher) => bound.push(publisher),
                    Err(_) if may_retry && attempt < RANK_PORT_ATTEMPTS => continue 'again,
                    Err(e) => return Err(e),
                }
            }
            return Ok(bound);
        }
    }

    /// Connections the ZMTP guards cut for going over their limits, so far (shared: it
    /// goes on counting).
    pub fn refused(&self) -> Arc<AtomicU64> {
        self.refused.clone()
    }

    /// Hands a batch to the publisher; waits while its queue is full. Returns false if the
    /// publisher has stopped.
    /// A publisher whose task has ended (as one that failed has).
    #[cfg(test)]
    pub(crate) fn stopped() -> Publisher {
        let (tx, _) = mpsc::channel(1);
        Publisher { tx, refused: Arc::default() }
    }

    pub async fn publish(&self, batch: EventBatch) -> bool {
        self.tx.send(batch).await.is_ok()
    }
}

async fn publish_loop(
    mut socket: PubSocket,
    mut rx: mpsc::Receiver<EventBatch>,
    config: PublisherConfig,
    topic: Bytes,
    buffer: RingBuffer,
) {
    // Until the publisher is dropped, and every batch handed over has gone out.
    while let Some(batch) = rx.recv().await {
        let seq = Seq(batch.seq);
        let payload = config.format.encode_payload(&batch);
        {
            let mut buf = buffer.lock().unwrap_or_else(|e| e.into_inner());
            if buf.len() == config.buffer_steps {
                buf.pop_front();
            }
            if config.buffer_steps > 0 {
                buf.push_back((seq, payload.clone()));
            }
        }
        let frames = framing::encode_live(topic.clone(), seq, payload);
        let msg = ZmqMessage::try_from(frames).expect("three frames");
        if let Err(e) = socket.send(msg).await {
            tracing::warn!(error = %e, seq = seq.0, "publishing a KV event batch failed");
        }
    }
    drop(socket.close().await);
}

/// How long a replay answer waits for room in its peer's queue before the rest of it is
/// dropped. A peer dropped from once is waited for [`STALLED_GRACE`] at most, for the whole
/// of each answer, until an answer reaches it whole.
const REPLAY_SEND_STALL: std::time::Duration = std::time::Duration::from_secs(1);
/// The whole wait an answer to a peer known not to read gets: a moment's lack of room does
/// not cost it its answer, and a peer that never reads holds up the others no longer.
const STALLED_GRACE: std::time::Duration = std::time::Duration::from_millis(20);
/// Most peers remembered as not reading (beyond, the memory starts over).
const STALLED_PEERS: usize = 1024;

async fn serve_replay(
    mut router: RouterSocket,
    topic: Bytes,
    buffer: RingBuffer,
    published: CancellationToken,
) {
    let mut stalled = std::collections::HashSet::new();
    loop {
        let msg = tokio::select! {
            msg = router.recv() => msg,
            () = published.cancelled() => break,
        };
        let mut frames = match msg {
            Ok(msg) => msg.into_vec(),
            Err(e) => {
                tracing::debug!(error = %e, "replay socket receive failed");
                continue;
            }
        };
        let identity = frames.remove(0);
        let start = match framing::decode_replay_request(&frames) {
            Ok(start) => start,
            Err(e) => {
                tracing::warn!(error = %e, "invalid replay request");
                continue;
            }
        };
        let batches: Vec<(Seq, Bytes)> = {
            let buf = buffer.lock().unwrap_or_else(|e| e.into_inner());
            buf.iter().filter(|(seq, _)| *seq >= start).cloned().collect()
        };
        tracing::debug!(start = start.0, batches = batches.len(), "serving replay");
        let replies = batches
            .into_iter()
            .map(|(seq, payload)| framing::encode_replay_batch(topic.clone(), seq, payload))
            .chain(std::iter::once(framing::encode_replay_end()));
        let graced = stalled.contains(&identity).then(|| tokio::time::Instant::now() + STALLED_GRACE);
        let mut whole = true;
        for mut reply in replies {
            reply.insert(0, identity.clone());
            let msg = ZmqMessage::try_from(reply).expect("non-empty frames");
            // (The send is polled once before the deadline is: past it, it goes when there
            // is room.)
            let deadline = graced.unwrap_or_else(|| tokio::time::Instant::now() + REPLAY_SEND_STALL);
            match tokio::time::timeout_at(deadline, router.send(msg)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "replay peer went away");
                    whole = false;
                    break;
                }
                Err(_) => {
                    tracing::warn!(
                        start = start.0,
                        "a replay peer is not reading its answers; the rest of this one is dropped"
                    );
                    if stalled.len() == STALLED_PEERS {
                        stalled.clear();
                    }
                    stalled.insert(identity.clone());
                    whole = false;
                    break;
                }
            }
        }
        if whole {
            stalled.remove(&identity);
        }
    }
    drop(router.close().await);
}

#[cfg(test)]
mod tests;
