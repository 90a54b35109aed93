//! Requests waiting for a replica's room ([`super::queue`]), each for the replicas that
//! refused it for want of room (at `--max-in-flight-per-replica`).
//!
//! - A request to one of them that ends wakes the request that has waited longest for it.
//! - A replica that joins the fleet or comes back (healthy again, no longer drained, serving
//!   again) wakes every waiting request: it may take any of them.
//! - A woken request decides again. Refused again (a request that arrived meanwhile took the
//!   room), it keeps its place in line; leaving instead (its client gone, its time up), it
//!   passes the wake on to the next request waiting for one of its replicas.
//! - A request that was deciding while a replica freed room decides again at once, so no
//!   wake falls between a decision and the wait that follows it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvroute_proto::ReplicaId;
use tokio::sync::Notify;

/// The line of requests waiting for a replica's room, shared by the fleet's replicas.
#[derive(Debug, Default)]
pub struct Waiters {
    /// By ticket: the order they first waited in.
    line: Mutex<BTreeMap<u64, Waiter>>,
    /// Entries of `line`, read without its lock (a request's end with nobody waiting takes
    /// no lock).
    count: AtomicUsize,
    /// Rooms freed so far ([`Waiters::frees`]).
    frees: AtomicU64,
    tickets: AtomicU64,
}

#[derive(Debug)]
struct Waiter {
    replicas: Arc<[ReplicaId]>,
    wake: Arc<Notify>,
}

impl Waiters {
    /// Rooms freed so far: read before a decision, it tells [`Ticket::wait`] whether one was
    /// freed during it.
    pub fn frees(&self) -> u64 {
        self.frees.load(SeqCst)
    }

    /// A request to `replica` ended: wakes the request waiting longest for it.
    pub fn freed(&self, replica: ReplicaId) {
        self.frees.fetch_add(1, SeqCst);
        if self.count.load(SeqCst) > 0 {
            self.wake_first(|replicas| replicas.contains(&replica));
        }
    }

    /// A replica joined or came back: wakes every waiting request.
    pub fn wake_all(&self) {
        self.frees.fetch_add(1, SeqCst);
        if self.count.load(SeqCst) == 0 {
            return;
        }
        let woken = std::mem::take(&mut *self.line());
        self.count.fetch_sub(woken.len(), SeqCst);
        for waiter in woken.into_values() {
            waiter.wake.notify_one();
        }
    }

    /// A place in line, taken when the request first waits.
    pub fn ticket(&self) -> Ticket<'_> {
        Ticket {
            waiters: self,
            id: self.tickets.fetch_add(1, SeqCst),
            wake: Arc::default(),
            replicas: Arc::new([]),
            state: State::Out,
        }
    }

    fn line(&self) -> MutexGuard<'_, BTreeMap<u64, Waiter>> {
        self.line.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wakes the first waiting request whose replicas `wanted` takes.
    fn wake_first(&self, wanted: impl Fn(&[ReplicaId]) -> bool) {
        let mut line = self.line();
        let Some(ticket) = line.iter().find(|(_, waiter)| wanted(&waiter.replicas)).map(|(t, _)| *t) else {
            return;
        };
        let waiter = line.remove(&ticket).expect("found");
        self.count.fetch_sub(1, SeqCst);
        drop(line);
        waiter.wake.notify_one();
    }
}

/// Where a request stands in line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not in line, holding no wake (deciding before its first wait, or again after a freed
    /// room it saw).
    Out,
    /// In line (unless a wake took it out since).
    InLine,
    /// Woken, deciding again: a wake it passes on if it leaves.
    Woken,
}

/// A request's place in [`Waiters`]' line, kept between its waits; dropped, it leaves the line.
#[derive(Debug)]
pub struct Ticket<'a> {
    waiters: &'a Waiters,
    id: u64,
    wake: Arc<Notify>,
    replicas: Arc<[ReplicaId]>,
    state: State,
}

impl Ticket<'_> {
    /// Waits for one of `replicas` to have room, unless one was freed since [`Waiters::frees`]
    /// read `seen` (then it returns at once: the request decides again).
    pub async fn wait(&mut self, replicas: &[ReplicaId], seen: u64) {
        {
            let mut line = self.waiters.line();
            // Still in line from a wait given up on (its future dropped): taken out first.
            if self.state == State::InLine && line.remove(&self.id).is_some() {
                self.waiters.count.fetch_sub(1, SeqCst);
            }
            // Counted before `frees` is read: a request's end that did not see it waiting
            // (and so took no lock) counted its room first, and is seen here.
            self.waiters.count.fetch_add(1, SeqCst);
            if self.waiters.frees.load(SeqCst) != seen {
                self.waiters.count.fetch_sub(1, SeqCst);
                self.state = State::Out;
                return;
            }
            self.replicas = replicas.into();
            line.insert(self.id, Waiter { replicas: self.replicas.clone(), wake: self.wake.clone() });
            self.state = State::InLine;
        }
        self.wake.notified().await;
        self.state = State::Woken;
    }

    /// The request got its room: nothing to pass on.
    pub fn placed(mut self) {
        self.state = State::Out;
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        let woken = match self.state {
            State::Out => false,
            State::Woken => true,
            State::InLine => {
                let left = self.waiters.line().remove(&self.id).is_some();
                if left {
                    self.waiters.count.fetch_sub(1, SeqCst);
                }
                // Not in line any more: a wake took it out just as it left.
                !left
            }
        };
        if woken {
            let replicas = self.replicas.clone();
            self.waiters.wake_first(|theirs| theirs.iter().any(|r| replicas.contains(r)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R0: ReplicaId = ReplicaId(0);
    const R1: ReplicaId = ReplicaId(1);

    /// Whether `wait` is done after being polled once more.
    async fn done(wait: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>) -> bool {
        futures::poll!(wait.as_mut()).is_ready()
    }

    #[tokio::test]
    async fn a_freed_replica_wakes_the_request_waiting_longest_for_it() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let (mut first, mut second, mut other) = (waiters.ticket(), waiters.ticket(), waiters.ticket());
        let first_wait = first.wait(&[R0], seen);
        let second_wait = second.wait(&[R0, R1], seen);
        let other_wait = other.wait(&[R1], seen);
        tokio::pin!(first_wait, second_wait, other_wait);
        assert!(
            !done(&mut first_wait).await && !done(&mut second_wait).await && !done(&mut other_wait).await
        );
        waiters.freed(R1);
        assert!(done(&mut second_wait).await, "the first waiting for R1");
        assert!(!done(&mut other_wait).await, "one wake a room");
        waiters.freed(R0);
        assert!(done(&mut first_wait).await);
        waiters.freed(R0);
        assert!(!done(&mut other_wait).await, "R0 is not its replica");
    }

    #[tokio::test]
    async fn a_room_freed_while_the_request_decided_is_not_waited_for() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        waiters.freed(R0);
        let mut ticket = waiters.ticket();
        let wait = ticket.wait(&[R0], seen);
        tokio::pin!(wait);
        assert!(done(&mut wait).await, "freed since it read `frees`");
    }

    #[tokio::test]
    async fn a_woken_request_that_leaves_passes_the_wake_on() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let (mut leaving, mut next) = (waiters.ticket(), waiters.ticket());
        {
            let wait = leaving.wait(&[R0], seen);
            tokio::pin!(wait);
            assert!(!done(&mut wait).await);
            let next_wait = next.wait(&[R0], seen);
            tokio::pin!(next_wait);
            assert!(!done(&mut next_wait).await);
            waiters.freed(R0);
            assert!(done(&mut wait).await);
            assert!(!done(&mut next_wait).await);
        }
        // `leaving` was woken and goes without deciding; `next` waits on with a new wait.
        let next_wait = next.wait(&[R0], waiters.frees());
        tokio::pin!(next_wait);
        assert!(!done(&mut next_wait).await);
        drop(leaving);
        assert!(done(&mut next_wait).await, "the wake passed on");
    }

    #[tokio::test]
    async fn a_placed_request_passes_nothing_on_and_a_replica_back_wakes_everyone() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let (mut placed, mut a, mut b) = (waiters.ticket(), waiters.ticket(), waiters.ticket());
        {
            let wait = placed.wait(&[R0], seen);
            tokio::pin!(wait);
            assert!(!done(&mut wait).await);
            waiters.freed(R0);
            assert!(done(&mut wait).await);
        }
        let seen = waiters.frees();
        let a_wait = a.wait(&[R0], seen);
        let b_wait = b.wait(&[R1], seen);
        tokio::pin!(a_wait, b_wait);
        assert!(!done(&mut a_wait).await && !done(&mut b_wait).await);
        placed.placed();
        assert!(!done(&mut a_wait).await, "nothing passed on");
        waiters.wake_all();
        assert!(done(&mut a_wait).await && done(&mut b_wait).await);
        assert_eq!(waiters.count.load(SeqCst), 0);
    }
}
