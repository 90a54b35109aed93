//! Event batches whose seqs are taken when their changes are made, under the cache lock.
//!
//! A change to the cache and the event that announces it are recorded in one critical
//! section, into a batch that already has its seq. A snapshot, under the same lock, seals the
//! open batch: every change it sees belongs to a batch at or below its seq, and every later
//! change goes to a batch above it. A subscriber that applies the snapshot and then the
//! batches after its seq therefore applies each change exactly once.

use kvroute_proto::pb;

/// Batches taken but not yet published, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    next_seq: u64,
    batches: Vec<(u64, Vec<pb::Event>)>,
    /// Whether the last of `batches` still takes events.
    open: bool,
}

impl Outbox {
    /// The open batch's events, opening a batch with the next seq if none is open.
    pub(crate) fn events(&mut self) -> &mut Vec<pb::Event> {
        if !self.open {
            self.batches.push((self.next_seq, Vec::new()));
            self.next_seq += 1;
            self.open = true;
        }
        &mut self.batches.last_mut().expect("a batch is open").1
    }

    /// Closes the open batch: later events get a new seq. Returns the seq of the newest batch
    /// taken so far, which includes every change recorded until now.
    pub(crate) fn seal(&mut self) -> Option<u64> {
        self.open = false;
        self.last_seq()
    }

    /// Seals and hands over every batch to publish, oldest first, with its seq.
    pub(crate) fn take(&mut self) -> Vec<(u64, Vec<pb::Event>)> {
        self.open = false;
        std::mem::take(&mut self.batches)
    }

    /// Seq of the newest batch taken (published or about to be), if any.
    pub(crate) fn last_seq(&self) -> Option<u64> {
        self.next_seq.checked_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cleared() -> pb::Event {
        pb::Event { kind: Some(pb::event::Kind::Cleared(pb::AllBlocksCleared {})) }
    }

    #[test]
    fn a_seal_splits_the_open_batch_and_seqs_stay_contiguous() {
        let mut outbox = Outbox::default();
        assert_eq!(outbox.seal(), None);
        outbox.events().push(cleared());
        outbox.events().push(cleared());
        assert_eq!(outbox.seal(), Some(0), "the snapshot includes batch 0");
        outbox.events().push(cleared());
        let batches = outbox.take();
        let shape: Vec<(u64, usize)> = batches.iter().map(|(seq, events)| (*seq, events.len())).collect();
        assert_eq!(shape, vec![(0, 2), (1, 1)]);
        assert!(outbox.take().is_empty());
        outbox.events().push(cleared());
        assert_eq!(outbox.take()[0].0, 2);
    }
}
