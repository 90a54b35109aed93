//! The replay client: asks a publisher's ROUTER socket for every buffered batch from a seq
//! on, over a fresh DEALER per request (a `zeromq` 0.7 DEALER never reconnects, and a
//! request sent to a dead peer vanishes without an error), with a timeout on the connect
//! and on every reply, and [`WHOLE_REPLAY`] of them for a whole attempt (a second attempt
//! follows one that ran out of budget: [`Budget`]). Both reply
//! layouts are accepted (`framing::decode_replay_reply`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_proto::Seq;
use kvroute_proto::framing::{self, FrameError, LiveMessage, ReplayReply};
use kvroute_proto::zmtp_guard::{OnRefused, ZmtpGuard};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use zeromq::prelude::*;
use zeromq::{DealerSocket, SocketOptions, ZmqMessage};

/// How many reply timeouts a whole attempt at a replay may take: a peer that drips batches just inside
/// the reply timeout must not keep a rank in repair (its stale entries still routed to) for
/// as long as its buffer lasts. A replay of 100 000 batches on a LAN takes seconds.
const WHOLE_REPLAY: u32 = 12;

/// Why a replay produced nothing usable.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    #[error("replay socket {endpoint}: {source}")]
    Socket {
        endpoint: String,
        #[source]
        source: zeromq::ZmqError,
    },
    #[error("replay socket {endpoint}: no ZMTP guard: {source}")]
    Guard {
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    #[error("replay from {endpoint} timed out")]
    Timeout { endpoint: String },
    #[error("malformed replay reply")]
    Malformed(#[from] FrameError),
    #[error("replay longer than {0} batches")]
    TooLong(usize),
    #[error("replays together would hold more than their budget of payload bytes")]
    OverBudget,
}

/// The most a replay may hold: batches, and bytes of payload drawn from a budget that every
/// replay shares (a router's replays run at once when it starts or its fleet reconnects). A
/// replay waits for budget that others hold, as long as it would wait for its next reply.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bounds<'a> {
    pub batches: usize,
    pub budget: &'a Budget,
}

/// Payload bytes every replay of a router shares, and a turn for those that ran out.
///
/// Replays that would fit one after the other can each hold part of the budget while they
/// wait for more, none able to finish and give some back. One that ran out gives back all it
/// held and tries again once, in turn with the others that ran out, so the rest finish and it
/// then gets its budget; a replay larger than the budget fails either way.
#[derive(Debug)]
pub(crate) struct Budget {
    bytes: Arc<Semaphore>,
    turn: tokio::sync::Mutex<()>,
}

impl Budget {
    pub(crate) fn new(bytes: usize) -> Self {
        let bytes = bytes.min(Semaphore::MAX_PERMITS);
        Self { bytes: Arc::new(Semaphore::new(bytes)), turn: tokio::sync::Mutex::new(()) }
    }

    #[cfg(test)]
    fn available(&self) -> usize {
        self.bytes.available_permits()
    }
}

/// Budget bytes a replay's batches hold until they are applied.
pub(crate) type Held = Option<OwnedSemaphorePermit>;

/// What a replay brought: its batches, the budget they hold, and whether the publisher's end
/// marker came. A replay whose replies stopped before the end marker came (a vLLM before
/// 0.33 drops what its send buffer cannot hold, the marker among it) keeps what it got:
/// those batches are as good as any, and the rest is a gap repaired from there.
#[derive(Debug)]
pub(crate) struct Replayed {
    pub batches: Vec<LiveMessage>,
    pub held: Held,
    pub ended: bool,
}

/// Every buffered batch with seq >= `start`, in the order the publisher sent them (through
/// a ZMTP guard, which calls `on_refused` for a message over its limits). A replay that ran
/// out of budget tries once more in turn ([`Budget`]).
pub(crate) async fn fetch(
    endpoint: &str,
    start: Seq,
    timeout: Duration,
    bounds: Bounds<'_>,
    on_refused: OnRefused,
) -> Result<Replayed, ReplayError> {
    match fetch_once(endpoint, start, timeout, bounds, on_refused.clone()).await {
        Err(ReplayError::OverBudget) => {
            // Waited for no longer than a whole replay: others' turns can be as long.
            let turn = tokio::time::timeout(timeout * WHOLE_REPLAY, bounds.budget.turn.lock());
            let Ok(_turn) = turn.await else { return Err(ReplayError::OverBudget) };
            fetch_once(endpoint, start, timeout, bounds, on_refused).await
        }
        done => done,
    }
}

async fn fetch_once(
    endpoint: &str,
    start: Seq,
    timeout: Duration,
    bounds: Bounds<'_>,
    on_refused: OnRefused,
) -> Result<Replayed, ReplayError> {
    let guard = ZmtpGuard::connecting(endpoint, on_refused)
        .await
        .map_err(|source| ReplayError::Guard { endpoint: endpoint.to_owned(), source })?;
    let socket_err = |source| ReplayError::Socket { endpoint: endpoint.to_owned(), source };
    let timed_out = || ReplayError::Timeout { endpoint: endpoint.to_owned() };
    let mut options = SocketOptions::default();
    options.connect_timeout(timeout);
    let mut dealer = DealerSocket::with_options(options);
    let deadline = tokio::time::Instant::now() + timeout * WHOLE_REPLAY;
    let result = async {
        tokio::time::timeout(timeout, dealer.connect(guard.endpoint()))
            .await
            .map_err(|_| timed_out())?
            .map_err(socket_err)?;
        let request: Vec<Bytes> = framing::encode_replay_request(start);
        let request = ZmqMessage::try_from(request).expect("a replay request has frames");
        dealer.send(request).await.map_err(socket_err)?;
        let mut batches = Vec::new();
        let mut held: Held = None;
        loop {
            let now = tokio::time::Instant::now();
            let reply_by = (now + timeout).min(deadline);
            let msg = match tokio::time::timeout_at(reply_by, dealer.recv()).await {
                Ok(msg) => msg.map_err(socket_err)?,
                // Replies that stopped (not a whole replay too slow) end what came.
                Err(_) if !batches.is_empty() && now + timeout <= deadline => {
                    return Ok(Replayed { batches, held, ended: false });
                }
                Err(_) => return Err(timed_out()),
            };
            match framing::decode_replay_reply(&msg.into_vec())? {
                ReplayReply::End => return Ok(Replayed { batches, held, ended: true }),
                ReplayReply::Batch(_) if batches.len() >= bounds.batches => {
                    return Err(ReplayError::TooLong(bounds.batches));
                }
                ReplayReply::Batch(mut batch) => {
                    let bytes = u32::try_from(batch.payload.len()).map_err(|_| ReplayError::OverBudget)?;
                    let wanted = bounds.budget.bytes.clone().acquire_many_owned(bytes);
                    let permit = tokio::time::timeout_at(reply_by, wanted)
                        .await
                        .map_err(|_| ReplayError::OverBudget)?
                        .map_err(|_| ReplayError::OverBudget)?;
                    // Kept as its payload alone, in a copy of its own: the socket cuts every
                    // frame out of one shared read buffer, which a kept slice holds whole, so
                    // the budget would count a fraction of what a replay held (and the topic,
                    // not read again, is dropped).
                    batch.payload = Bytes::copy_from_slice(&batch.payload);
                    batch.topic = Bytes::new();
                    match &mut held {
                        Some(held) => held.merge(permit),
                        None => held = Some(permit),
                    }
                    batches.push(batch);
                }
            }
        }
    }
    .await;
    for e in dealer.close().await {
        tracing::debug!(error = %e, endpoint, "closing a replay socket");
    }
    result
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use zeromq::RouterSocket;

    use super::*;

    fn unbounded(budget: &Budget) -> Bounds<'_> {
        Bounds { batches: usize::MAX, budget }
    }

    fn budget(bytes: usize) -> Budget {
        Budget::new(bytes)
    }

    /// A peer that answers each replay request, one after the other, with a one-byte batch
    /// every `every`: `n` of them and the replay's end, or batches without end (until the
    /// requester is gone).
    async fn peer(every: Duration, n: Option<u64>) -> String {
        peer_ending(every, n, true).await
    }

    /// [`peer`], whose `n` batches are followed by the end marker only if `end`.
    async fn peer_ending(every: Duration, n: Option<u64>, end: bool) -> String {
        let mut router = RouterSocket::new();
        let endpoint = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
        tokio::spawn(async move {
            while let Ok(request) = router.recv().await {
                let peer = request.into_vec()[0].clone();
                let batches = (0..n.unwrap_or(u64::MAX)).map(|seq| {
                    framing::encode_replay_batch(Bytes::new(), Seq(seq), Bytes::from_static(b"x"))
                });
                let marker = n.filter(|_| end).map(|_| framing::encode_replay_end());
                for frames in batches.chain(marker) {
                    tokio::time::sleep(every).await;
                    let frames: Vec<Bytes> = std::iter::once(peer.clone()).chain(frames).collect();
                    if router.send(ZmqMessage::try_from(frames).unwrap()).await.is_err() {
                        break;
                    }
                }
            }
        });
        endpoint
    }

    /// A peer that answers a replay with one batch every `every` and never ends it.
    async fn dripping_peer(every: Duration) -> String {
        peer(every, None).await
    }

    /// Through the ZMTP guard: without it, `zeromq` would reserve 2^62 bytes and abort.
    #[tokio::test]
    async fn a_replay_peer_announcing_a_huge_frame_is_cut_off_and_counted() {
        let endpoint = kvroute_proto::zmtp_guard::huge_frame_peer().await.unwrap();
        let refused = Arc::new(AtomicU64::new(0));
        let counted = refused.clone();
        let on_refused = Arc::new(move || {
            counted.fetch_add(1, Ordering::Relaxed);
        });
        let budget = budget(1 << 20);
        let result =
            fetch(&endpoint, Seq(0), Duration::from_millis(500), unbounded(&budget), on_refused).await;
        assert!(
            matches!(result, Err(ReplayError::Socket { .. } | ReplayError::Timeout { .. })),
            "{result:?}"
        );
        assert!(refused.load(Ordering::Relaxed) >= 1);
    }

    #[tokio::test]
    async fn a_replay_that_never_ends_times_out_as_a_whole() {
        // Each batch comes well inside the reply timeout; the replay as a whole does not.
        let timeout = Duration::from_millis(100);
        let endpoint = dripping_peer(Duration::from_millis(20)).await;
        let budget = budget(1 << 20);
        let result = tokio::time::timeout(
            Duration::from_secs(10),
            fetch(&endpoint, Seq(0), timeout, unbounded(&budget), Arc::new(|| {})),
        )
        .await
        .expect("the replay ends");
        // (Without the whole-replay deadline, the outer timeout fails the test instead.)
        assert!(matches!(result, Err(ReplayError::Timeout { .. })), "{result:?}");
    }

    /// A replay whose replies stop before the end marker (dropped by a publisher's full send
    /// buffer) keeps the batches that came; one that brought nothing fails.
    #[tokio::test]
    async fn a_replay_without_its_end_marker_keeps_what_came() {
        let budget = budget(1 << 20);
        let endpoint = peer_ending(Duration::ZERO, Some(3), false).await;
        // The timeout ends each replay here: long enough for a loaded machine's batches.
        let timeout = Duration::from_secs(1);
        let replayed = fetch(&endpoint, Seq(0), timeout, unbounded(&budget), Arc::new(|| {})).await.unwrap();
        let seqs: Vec<u64> = replayed.batches.iter().map(|b| b.seq.0).collect();
        assert_eq!((seqs, replayed.ended), (vec![0, 1, 2], false));
        let endpoint = peer_ending(Duration::ZERO, Some(0), false).await;
        let result = fetch(&endpoint, Seq(0), timeout, unbounded(&budget), Arc::new(|| {})).await;
        assert!(matches!(result, Err(ReplayError::Timeout { .. })), "{result:?}");
    }

    /// A replay is held whole before it is applied: one past its bounds, in batches or in
    /// the bytes left of the shared budget, fails instead of growing.
    #[tokio::test]
    async fn a_replay_past_its_bounds_fails() {
        let shared = budget(5);
        let other_replay = shared.bytes.clone().try_acquire_many_owned(2).unwrap();
        let endpoint = dripping_peer(Duration::from_millis(1)).await;
        let result =
            fetch(&endpoint, Seq(0), Duration::from_millis(300), unbounded(&shared), Arc::new(|| {})).await;
        assert!(matches!(result, Err(ReplayError::OverBudget)), "4 one-byte batches, 3 left: {result:?}");
        assert_eq!(shared.available(), 3, "a failed replay gives its bytes back");
        drop(other_replay);
        let endpoint = dripping_peer(Duration::from_millis(1)).await;
        let batches = Bounds { batches: 3, budget: &shared };
        let result = fetch(&endpoint, Seq(0), Duration::from_secs(5), batches, Arc::new(|| {})).await;
        assert!(matches!(result, Err(ReplayError::TooLong(3))), "{result:?}");
    }

    /// A replay that finds the budget held by another waits for it (within its reply
    /// timeout) instead of failing.
    #[tokio::test]
    async fn a_replay_waits_for_budget_another_replay_gives_back() {
        let shared = budget(4);
        let other_replay = shared.bytes.clone().try_acquire_many_owned(3).unwrap();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            drop(other_replay);
        });
        let endpoint = peer(Duration::ZERO, Some(3)).await;
        let result =
            fetch(&endpoint, Seq(0), Duration::from_secs(5), unbounded(&shared), Arc::new(|| {})).await;
        let Replayed { batches, held, ended } = result.expect("the budget came back in time");
        assert_eq!((batches.len(), held.map(|h| h.num_permits()), ended), (3, Some(3), true));
    }

    /// Two replays that would fit one after the other, run at once, each hold part of the
    /// budget and wait for more: the first to run out gives its part back and tries again in
    /// turn, so both succeed (one used to fail, and its rank lost its index).
    #[tokio::test]
    async fn replays_that_fit_one_after_the_other_both_succeed_at_once() {
        let shared = budget(10);
        let (a, b) =
            (peer(Duration::from_millis(1), Some(8)).await, peer(Duration::from_millis(1), Some(8)).await);
        // The first to wait this long for budget gives its part back: short enough for a test,
        // long enough for a loaded machine's batches.
        let timeout = Duration::from_secs(1);
        // Each applied, and its budget given back, as soon as it is complete.
        let replay = async |endpoint| {
            let replayed = fetch(endpoint, Seq(0), timeout, unbounded(&shared), Arc::new(|| {})).await?;
            Ok::<_, ReplayError>(replayed.batches.len())
        };
        let (a, b) = tokio::join!(replay(&a), replay(&b));
        assert_eq!((a.expect("each fits alone"), b.expect("each fits alone")), (8, 8));
        assert_eq!(shared.available(), 10);
    }
}
