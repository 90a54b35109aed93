//! The socket task's end of its channel to the stream task: live messages go in with
//! `try_send`, so a stream busy with a repair never stalls the socket (the publisher's queue
//! is unbounded); what does not fit is dropped, counted (`overflow`), and reported to the
//! stream ([`Input::Overflowed`]), which repairs the hole (a replay, else a snapshot, else
//! it clears the rank and follows the live stream from there).
//!
//! The channel is bounded twice: by its slots, and by `max_queued_bytes` of frames, each
//! frame's own cost counted (a message can be up to the ZMTP guard's 64 MiB and 1024 frames,
//! so a count alone bounds nothing). Every rank's channel shares one more bound, of bytes
//! ([`Shared`]): when the fleet reconnects, every rank busy with a replay, their channels
//! would fill together (at ~64 MiB each, 200 ranks' come to 12 GiB).
//!
//! A report owes its place in the order: it goes in before any live message after the drops
//! (one that does not fit behind it is dropped too). Queued after one, the stream would see
//! the hole itself first, repair it, and then repair it again for the report. And one report
//! waits for the stream at a time ([`Pending`]), so a channel full of bytes, its slots free,
//! does not fill with reports, each a repair. Drops while it waits are reported once more
//! after the stream takes it: its repair may not reach them (one that clears the rank and
//! follows the live stream takes what is queued behind the report as it comes). Meanwhile
//! later messages still queue behind the waiting report: those the stream applies before
//! the second report's repair are checked again by it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use bytes::Bytes;
use kvroute_proto::zmtp_guard::frames::FRAME_CHARGE;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;

use super::subscriber::Input;

/// The stream task has gone away.
#[derive(Debug)]
pub(crate) struct Closed;

/// Whether an [`Input::Overflowed`] waits for the stream (which takes it, [`Pending::take`],
/// before its repair): while one does, no other is sent.
#[derive(Clone, Debug, Default)]
pub(crate) struct Pending(Arc<AtomicBool>);

impl Pending {
    /// The stream has the report: the drops since it was sent may be reported.
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

/// The bytes every rank's queued live messages hold together, and their bound.
#[derive(Clone, Debug)]
pub(crate) struct Shared {
    queued: Arc<AtomicUsize>,
    limit: usize,
}

impl Shared {
    pub(crate) fn new(limit: usize) -> Self {
        Self { queued: Arc::default(), limit }
    }
}

/// A live message's share of its channel's bytes and of every channel's ([`Shared`]), given
/// back when the message is dropped.
#[derive(Debug)]
pub(crate) struct Queued {
    bytes: usize,
    queued: Arc<AtomicUsize>,
    shared: Arc<AtomicUsize>,
}

/// Counts `bytes` in `queued`, unless that would take it past `limit`.
fn count(queued: &AtomicUsize, bytes: usize, limit: usize) -> bool {
    let fits = |held: usize| held.checked_add(bytes).filter(|&total| total <= limit);
    queued.fetch_update(Ordering::AcqRel, Ordering::Acquire, fits).is_ok()
}

impl Queued {
    /// Counts `bytes` in `queued` and in `shared`, unless that would take either past its
    /// limit.
    fn take(queued: &Arc<AtomicUsize>, bytes: usize, limit: usize, shared: &Shared) -> Option<Queued> {
        if !count(queued, bytes, limit) {
            return None;
        }
        if !count(&shared.queued, bytes, shared.limit) {
            queued.fetch_sub(bytes, Ordering::AcqRel);
            return None;
        }
        Some(Queued { bytes, queued: queued.clone(), shared: shared.queued.clone() })
    }
}

impl Drop for Queued {
    fn drop(&mut self) {
        self.queued.fetch_sub(self.bytes, Ordering::AcqRel);
        self.shared.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One subscriber's sending end. It outlives the subscriber's sockets: messages of an
/// earlier one may still be queued, and its report may still wait.
pub(crate) struct Outbox {
    tx: mpsc::Sender<Input>,
    queued: Arc<AtomicUsize>,
    max_queued_bytes: usize,
    shared: Shared,
    pending: Pending,
    /// Messages were dropped since the last report was sent.
    owed: bool,
    overflow: Counter,
}

impl Outbox {
    pub(crate) fn new(
        tx: mpsc::Sender<Input>,
        (max_queued_bytes, shared): (usize, Shared),
        overflow: Counter,
    ) -> Self {
        let queued = Arc::new(AtomicUsize::new(0));
        Self { tx, queued, max_queued_bytes, shared, pending: Pending::default(), owed: false, overflow }
    }

    /// Queues one live message's frames (as copies: the socket cuts every frame out of one
    /// shared read buffer, as large as the largest message lately, which a queued slice would
    /// hold whole, uncounted), after the report owed; drops it if either does not fit.
    pub(crate) fn offer(&mut self, frames: &[Bytes]) -> Result<(), Closed> {
        if self.owes() {
            match self.tx.clone().try_reserve() {
                Ok(permit) => self.report(permit),
                Err(TrySendError::Full(())) => {}
                Err(TrySendError::Closed(())) => return Err(Closed),
            }
        }
        let bytes = frames.iter().map(|f| f.len() + FRAME_CHARGE as usize).sum();
        let sent = !self.owes()
            && match Queued::take(&self.queued, bytes, self.max_queued_bytes, &self.shared) {
                Some(share) => {
                    let copies = frames.iter().map(|frame| Bytes::copy_from_slice(frame)).collect();
                    match self.tx.try_send(Input::Frames(copies, share)) {
                        Ok(()) => true,
                        Err(TrySendError::Full(_)) => false,
                        Err(TrySendError::Closed(_)) => return Err(Closed),
                    }
                }
                None => false,
            };
        if !sent {
            self.overflow.inc();
            self.owed = true;
        }
        Ok(())
    }

    /// Whether a report is due (sent through [`Self::report`] as soon as there is a slot,
    /// even if no later message comes to reveal the drops): one is owed, and none waits.
    pub(crate) fn owes(&self) -> bool {
        self.owed && !self.pending.is_set()
    }

    /// Sends the report owed ([`Self::owes`]) in `slot`, reserved on this outbox's channel.
    pub(crate) fn report(&mut self, slot: mpsc::Permit<'_, Input>) {
        slot.send(Input::Overflowed(self.pending.set()));
        self.owed = false;
    }

    /// A new connection: the stream repairs after it (from seq 0 once the last one dropped,
    /// else from where it is), which covers every drop before.
    pub(crate) fn forgive(&mut self) {
        self.owed = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(n: u8) -> Vec<Bytes> {
        vec![Bytes::from_static(b"kv-events"), Bytes::from(vec![n])]
    }

    /// What the stream would take next: a message's number, `None` for a report (taken),
    /// nothing when the channel is empty.
    fn next(rx: &mut mpsc::Receiver<Input>) -> Option<Option<u8>> {
        match rx.try_recv().ok()? {
            Input::Frames(frames, _) => Some(Some(frames[1][0])),
            Input::Overflowed(pending) => {
                pending.take();
                Some(None)
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    fn drain(rx: &mut mpsc::Receiver<Input>) -> Vec<Option<u8>> {
        std::iter::from_fn(|| next(rx)).collect()
    }

    /// Regression: a message that arrived as the stream freed a slot could take it before the
    /// report of the drops before it; the stream saw that hole, repaired it, and then repaired
    /// it again for the report (a spurious DEGRADED).
    #[test]
    fn drops_are_reported_before_the_messages_after_them() {
        let (tx, mut rx) = mpsc::channel(2);
        let overflow = Counter::default();
        let mut outbox = Outbox::new(tx, (usize::MAX, Shared::new(usize::MAX)), overflow.clone());
        for n in 1..=3 {
            outbox.offer(&message(n)).unwrap();
        }
        assert!(outbox.owes());
        assert_eq!(next(&mut rx), Some(Some(1)));
        // One slot: the report takes it, and 4 (which would have come before it) is dropped.
        outbox.offer(&message(4)).unwrap();
        outbox.offer(&message(5)).unwrap();
        assert_eq!(drain(&mut rx), [Some(2), None]);
        assert_eq!(overflow.get(), 3);
        // 5 was dropped behind the report: reported again, ahead of 6.
        outbox.offer(&message(6)).unwrap();
        assert_eq!(drain(&mut rx), [None, Some(6)]);
    }

    /// Drops while a report waits are reported again once the stream has taken it, not
    /// before: one report waits at a time, and its repair may not reach them. (Regression:
    /// taken as covered, a drop removing a block that a message queued behind the report had
    /// stored was lost when the report's repair could not replay and followed the live
    /// stream: the index kept the block, EXACT.)
    #[test]
    fn drops_behind_a_waiting_report_are_reported_after_it() {
        let (tx, mut rx) = mpsc::channel(2);
        let mut outbox = Outbox::new(tx.clone(), (usize::MAX, Shared::new(usize::MAX)), Counter::default());
        for n in 1..=3 {
            outbox.offer(&message(n)).unwrap();
        }
        assert_eq!(next(&mut rx), Some(Some(1)));
        outbox.report(tx.try_reserve().unwrap());
        outbox.offer(&message(4)).unwrap();
        assert!(!outbox.owes(), "4 was dropped behind a waiting report");
        assert_eq!(drain(&mut rx), [Some(2), None]);
        assert!(outbox.owes(), "the report of 4 is due once the first is taken");
        outbox.report(tx.try_reserve().unwrap());
        outbox.offer(&message(5)).unwrap();
        assert!(!outbox.owes());
        assert_eq!(drain(&mut rx), [None, Some(5)]);
    }

    /// A channel full of bytes has free slots: one report goes in, not one per drop.
    #[test]
    fn a_channel_full_of_bytes_holds_one_report() {
        let (tx, mut rx) = mpsc::channel(1024);
        let overflow = Counter::default();
        let one: usize = message(0).iter().map(|f| f.len() + FRAME_CHARGE as usize).sum();
        let mut outbox = Outbox::new(tx, (2 * one, Shared::new(usize::MAX)), overflow.clone());
        for n in 1..=10 {
            outbox.offer(&message(n)).unwrap();
        }
        assert_eq!(overflow.get(), 8);
        assert_eq!(drain(&mut rx), [Some(1), Some(2), None]);
        // The bytes are given back as the stream drops what it took; 4 to 10, dropped behind
        // the report, have one more.
        outbox.offer(&message(11)).unwrap();
        assert_eq!(drain(&mut rx), [None, Some(11)]);
    }

    /// Every channel's bytes share one bound: a rank whose own channel has room drops what
    /// would take the fleet's past it, and reports the drop; bytes given back by another
    /// rank's stream make room again.
    #[test]
    fn the_channels_share_one_bound_of_bytes() {
        let one: usize = message(0).iter().map(|f| f.len() + FRAME_CHARGE as usize).sum();
        let shared = Shared::new(3 * one);
        let ((tx_a, mut rx_a), (tx_b, mut rx_b)) = (mpsc::channel(64), mpsc::channel(64));
        let (overflow_a, overflow_b) = (Counter::default(), Counter::default());
        let mut a = Outbox::new(tx_a, (usize::MAX, shared.clone()), overflow_a.clone());
        let mut b = Outbox::new(tx_b, (usize::MAX, shared.clone()), overflow_b.clone());
        for n in 1..=2 {
            a.offer(&message(n)).unwrap();
        }
        b.offer(&message(3)).unwrap();
        b.offer(&message(4)).unwrap();
        assert_eq!((overflow_a.get(), overflow_b.get()), (0, 1), "the fleet's bytes are taken");
        assert_eq!(drain(&mut rx_a), [Some(1), Some(2)]);
        b.offer(&message(5)).unwrap();
        assert_eq!(drain(&mut rx_b), [Some(3), None, Some(5)], "room again once a's were taken");
    }
}
