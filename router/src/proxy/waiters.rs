//! Requests waiting for a replica's room ([`super::queue`]), each for the replicas that
//! refused it for want of room (at `--max-in-flight-per-replica`).
//!
//! - A request to one of them that ends wakes the request that has waited longest for it
//!   among those of the lowest `priority` (vLLM's field: lower is served first).
//! - A replica that joins the fleet or comes back (healthy again, no longer drained, serving
//!   again, its ejection over) wakes every waiting request: it may take any of them.
//! - The room that woke a request is held for it until it decides ([`Waiters::held_for_others`]):
//!   a request that arrives meanwhile, or another's retry, finds the replica saturated and
//!   waits behind it, so that the line is served in its order. (Only moments are open: between
//!   a request's end and the wake it gives; and for requests not routed on their prompt,
//!   between the decision and the send. A routed request's decision, or its retry's, takes its
//!   room in one step with the check that there is one
//!   ([`super::upstream::Upstream::try_begin`]), so two of them deciding at once never pass
//!   the limit, and the hold ends as it does ([`Waiters::took`]).)
//! - A woken request decides again. Refused again for want of room there (another took it
//!   after all), it lets the hold go, and it and those the hold refused decide again; refused
//!   for another reason, it passes the room on. Either way it keeps its place in line. Sent to another replica than the one whose room
//!   woke it, or leaving (its client gone, its time up), it passes the room on to the next
//!   request waiting for that replica, or frees it.
//! - A request that was deciding while a replica freed room decides again at once, so no
//!   wake falls between a decision and the wait that follows it.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use kvroute_proto::ReplicaId;
use tokio::sync::Notify;

/// The line of requests waiting for a replica's room, shared by the fleet's replicas.
#[derive(Debug, Default)]
pub struct Waiters {
    /// By place: their priority (lower first), then the order they first waited in.
    line: Mutex<BTreeMap<Place, Waiter>>,
    /// Entries of `line`, read without its lock (a request's end with nobody waiting takes
    /// no lock).
    count: AtomicUsize,
    /// Rooms freed so far ([`Waiters::frees`]).
    frees: AtomicU64,
    tickets: AtomicU64,
    /// Rooms held for woken requests, by replica.
    held: Mutex<HashMap<ReplicaId, u32>>,
    /// Rooms in `held`, read without its lock (a decision with none held takes no lock).
    holds: AtomicUsize,
}

tokio::task_local! {
    /// The room the deciding request holds ([`Waiters::held_for_others`], [`Waiters::took`]).
    static HOLDING: Option<Hold>;
}

/// `decision` made by a request that holds `room` ([`Ticket::hold`]): that room counts as
/// its own.
pub async fn holding<F: std::future::Future>(room: Option<Hold>, decision: F) -> F::Output {
    HOLDING.scope(room, decision).await
}

/// A woken request's hold on a replica's room, as its decision sees it.
#[derive(Clone, Debug)]
pub struct Hold {
    replica: ReplicaId,
    wake: Arc<Wake>,
}

impl Hold {
    /// Whether it is `replica`'s room, still held (not yet [taken](Waiters::took)).
    fn holds(&self, replica: ReplicaId) -> bool {
        self.replica == replica && self.wake.room.load(SeqCst) == u64::from(replica.0)
    }
}

#[derive(Debug)]
struct Waiter {
    replicas: Arc<[ReplicaId]>,
    wake: Arc<Wake>,
}

/// How a ticket is woken: told, with the replica whose room woke it.
#[derive(Debug)]
struct Wake {
    notify: Notify,
    /// The replica's id, its room held for the request until it lets it go
    /// ([`Ticket::let_go`]); or [`ALL`] (not woken, or woken because a replica joined or came
    /// back: no room held).
    room: AtomicU64,
}

impl Default for Wake {
    fn default() -> Self {
        Self { notify: Notify::new(), room: AtomicU64::new(ALL) }
    }
}

/// [`Wake::room`] of a wake for every waiting request.
const ALL: u64 = u64::MAX;

impl Wake {
    fn wake(&self, room: u64) {
        self.room.store(room, SeqCst);
        self.notify.notify_one();
    }
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
            self.wake_first(replica);
        }
    }

    /// A replica joined or came back: wakes every waiting request.
    pub fn wake_all(&self) {
        self.frees.fetch_add(1, SeqCst);
        if self.count.load(SeqCst) == 0 {
            return;
        }
        let mut line = self.line();
        self.count.fetch_sub(line.len(), SeqCst);
        // Told under the line's lock: a ticket dropped on another thread that finds itself
        // out of line reads the room it was woken for (see [`Waiters::wake_first`]).
        for waiter in std::mem::take(&mut *line).into_values() {
            waiter.wake.wake(ALL);
        }
    }

    /// A place in line, taken when the request first waits.
    pub fn ticket(&self, priority: i64) -> Ticket<'_> {
        self.ticket_kept(priority, &AtomicU64::new(0))
    }

    /// [`Waiters::ticket`] at the place `kept` holds (one more than its number; 0: none yet,
    /// and it is given the new one): a request that waits again (a retry) keeps its turn
    /// ahead of those that came after it.
    pub fn ticket_kept(&self, priority: i64, kept: &AtomicU64) -> Ticket<'_> {
        let number = match kept.load(SeqCst) {
            0 => {
                let number = self.tickets.fetch_add(1, SeqCst);
                kept.store(number + 1, SeqCst);
                number
            }
            kept => kept - 1,
        };
        Ticket { waiters: self, id: (priority, number), wake: Arc::default(), state: State::Out }
    }

    fn line(&self) -> MutexGuard<'_, BTreeMap<Place, Waiter>> {
        self.line.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn held(&self) -> MutexGuard<'_, HashMap<ReplicaId, u32>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Rooms on `replica` held for woken requests other than the deciding one: they count as
    /// taken ([`super::upstream::Upstream::has_room`]).
    pub fn held_for_others(&self, replica: ReplicaId) -> u32 {
        if self.holds.load(SeqCst) == 0 {
            return 0;
        }
        let held = self.held().get(&replica).copied().unwrap_or(0);
        let own = HOLDING.try_with(|hold| hold.as_ref().is_some_and(|h| h.holds(replica))).unwrap_or(false);
        held.saturating_sub(u32::from(own))
    }

    /// The deciding request took a room on `replica` ([`super::upstream::Upstream::try_begin`]):
    /// the room it holds there, if it does, is held no more; true if it was. (Still held until
    /// the request was placed, the room counted twice meanwhile, and a request deciding then
    /// found the replica saturated and waited, with nothing to wake it.)
    pub fn took(&self, replica: ReplicaId) -> bool {
        if self.holds.load(SeqCst) == 0 {
            return false;
        }
        let own = HOLDING.try_with(|hold| hold.clone().filter(|h| h.replica == replica)).ok().flatten();
        let room = u64::from(replica.0);
        let took = own.is_some_and(|hold| hold.wake.room.compare_exchange(room, ALL, SeqCst, SeqCst).is_ok());
        if took {
            self.unhold(replica);
        }
        took
    }

    fn hold(&self, replica: ReplicaId) {
        *self.held().entry(replica).or_default() += 1;
        self.holds.fetch_add(1, SeqCst);
    }

    fn unhold(&self, replica: ReplicaId) {
        let mut held = self.held();
        if let Some(n) = held.get_mut(&replica) {
            *n -= 1;
            if *n == 0 {
                held.remove(&replica);
            }
            self.holds.fetch_sub(1, SeqCst);
        }
    }

    /// Wakes the request waiting longest for `replica`'s room.
    fn wake_first(&self, replica: ReplicaId) {
        let mut line = self.line();
        let first = line.iter().find(|(_, waiter)| waiter.replicas.contains(&replica));
        let Some(ticket) = first.map(|(ticket, _)| *ticket) else { return };
        let waiter = line.remove(&ticket).expect("found");
        self.count.fetch_sub(1, SeqCst);
        // Held, and told, before the lock is let go: a ticket dropped on another thread just
        // now finds itself out of line only once it is told which room woke it, and passes
        // that on (told after, it could read none, and leave the next request asleep).
        self.hold(replica);
        waiter.wake.wake(replica.0.into());
    }
}

/// A request's place in line: its priority (lower first; vLLM's `priority`), then its
/// ticket's number (first come, first served).
type Place = (i64, u64);

/// What [`Ticket::join`] did.
enum Joined {
    /// In line (or woken already).
    Waiting,
    /// Not in line: room was freed while the request decided.
    Freed,
}

/// Where a request stands in line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Not in line, holding no wake (deciding before its first wait, or again after a freed
    /// room it saw).
    Out,
    /// In line (unless a wake took it out since).
    InLine,
    /// Woken, deciding again: a wake it passes on unless it takes the room.
    Woken,
}

/// A request's place in [`Waiters`]' line, kept between its waits; dropped, it leaves the line.
#[derive(Debug)]
pub struct Ticket<'a> {
    waiters: &'a Waiters,
    id: Place,
    wake: Arc<Wake>,
    state: State,
}

impl Ticket<'_> {
    /// Waits for one of `replicas` to have room, unless one was freed since [`Waiters::frees`]
    /// read `seen` (then it returns at once: the request decides again).
    pub async fn wait(&mut self, replicas: &[ReplicaId], seen: u64) {
        match self.join(replicas, seen) {
            Joined::Waiting => {
                self.wake.notify.notified().await;
                self.state = State::Woken;
            }
            // Let the runtime run between decisions that follow one another at once.
            Joined::Freed => tokio::task::yield_now().await,
        }
    }

    /// Puts the request in line for `replicas`, unless one was freed since `seen`.
    fn join(&mut self, replicas: &[ReplicaId], seen: u64) -> Joined {
        // Woken, and refused again. (Before the line's lock: `freed` takes it.)
        if self.state == State::Woken
            && let Some(room) = self.take_hold()
        {
            if replicas.contains(&room) {
                // For want of room there: another took it after all (the replica is over its
                // limit), so there is no room to pass on (passed on, holds for rooms that do
                // not exist would keep the replica saturated). Those refused because of the
                // hold decide again, this request among them.
                self.waiters.frees.fetch_add(1, SeqCst);
            } else {
                // For another reason (the replica is draining, say): the room is there, for
                // the next request waiting for it.
                self.waiters.freed(room);
            }
        }
        let mut line = self.waiters.line();
        // Still in line from a wait given up on (its future dropped): taken out first, or,
        // if a wake took it out since, woken (its stored permit ends the wait at once).
        if self.state == State::InLine {
            match line.remove(&self.id) {
                Some(_) => _ = self.waiters.count.fetch_sub(1, SeqCst),
                None => return Joined::Waiting,
            }
        }
        // Counted before `frees` is read: a request's end that did not see it waiting (and
        // so took no lock) counted its room first, and is seen here.
        self.waiters.count.fetch_add(1, SeqCst);
        if self.waiters.frees.load(SeqCst) != seen {
            self.waiters.count.fetch_sub(1, SeqCst);
            self.state = State::Out;
            return Joined::Freed;
        }
        line.insert(self.id, Waiter { replicas: replicas.into(), wake: self.wake.clone() });
        self.state = State::InLine;
        Joined::Waiting
    }

    /// The request got its room on `replica`: the room it holds, if it was another
    /// replica's, goes on to the next request waiting for that one.
    pub fn placed(mut self, replica: Option<ReplicaId>) {
        self.let_go(replica);
        self.state = State::Out;
    }

    /// The replica whose room it holds, woken by its freeing (`None`: not woken, or woken by
    /// a replica's return, which holds nothing).
    pub fn holding(&self) -> Option<ReplicaId> {
        // [`ALL`] is no replica's id.
        u32::try_from(self.wake.room.load(SeqCst)).ok().map(ReplicaId)
    }

    /// The room it holds, for its decision ([`holding`]).
    pub fn hold(&self) -> Option<Hold> {
        self.holding().map(|replica| Hold { replica, wake: self.wake.clone() })
    }

    /// Lets the room it holds go: taken (the request goes to that replica, `took`), or passed
    /// on to the next request waiting for it, or else freed.
    fn let_go(&mut self, took: Option<ReplicaId>) {
        if let Some(room) = self.take_hold().filter(|&room| took != Some(room)) {
            self.waiters.freed(room);
        }
    }

    /// The room it holds, no longer held (it holds none after).
    fn take_hold(&mut self) -> Option<ReplicaId> {
        // [`ALL`] is no replica's id.
        let room = u32::try_from(self.wake.room.swap(ALL, SeqCst)).ok().map(ReplicaId)?;
        self.waiters.unhold(room);
        Some(room)
    }
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        // Out of line (unless a wake took it out just as it left: the room is told first, and
        // held for it), it lets go of any room it holds.
        if self.state == State::InLine && self.waiters.line().remove(&self.id).is_some() {
            self.waiters.count.fetch_sub(1, SeqCst);
        }
        self.let_go(None);
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
        let (mut first, mut second, mut other) = (waiters.ticket(0), waiters.ticket(0), waiters.ticket(0));
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

    /// A room goes to the waiting request of the lowest priority first, whenever it came.
    #[tokio::test]
    async fn a_freed_replica_wakes_the_lowest_priority_first() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let (mut early, mut urgent, mut urgent_later) =
            (waiters.ticket(0), waiters.ticket(-5), waiters.ticket(-5));
        let early_wait = early.wait(&[R0], seen);
        let urgent_wait = urgent.wait(&[R0], seen);
        let later_wait = urgent_later.wait(&[R0], seen);
        tokio::pin!(early_wait, urgent_wait, later_wait);
        assert!(
            !done(&mut early_wait).await && !done(&mut urgent_wait).await && !done(&mut later_wait).await
        );
        waiters.freed(R0);
        assert!(done(&mut urgent_wait).await, "the lowest priority first");
        assert!(!done(&mut later_wait).await && !done(&mut early_wait).await);
        waiters.freed(R0);
        assert!(done(&mut later_wait).await, "then first come, first served");
        assert!(!done(&mut early_wait).await);
    }

    #[tokio::test(start_paused = true)]
    async fn a_room_freed_while_the_request_decided_is_not_waited_for() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        waiters.freed(R0);
        let mut ticket = waiters.ticket(0);
        let wait = ticket.wait(&[R0], seen);
        let ended = tokio::time::timeout(std::time::Duration::from_secs(1), wait).await;
        assert!(ended.is_ok(), "freed since it read `frees`");
        assert_eq!(waiters.count.load(SeqCst), 0);
    }

    /// A woken request that leaves, or takes room elsewhere, passes the wake on to the next
    /// waiting for the replica whose room woke it (not for another of its replicas).
    #[tokio::test]
    async fn a_wake_not_taken_goes_to_the_next_waiting_for_that_replica() {
        for placed_elsewhere in [false, true] {
            let waiters = Waiters::default();
            let seen = waiters.frees();
            let (mut woken, mut for_r1, mut for_r0) =
                (waiters.ticket(0), waiters.ticket(0), waiters.ticket(0));
            {
                let wait = woken.wait(&[R0, R1], seen);
                tokio::pin!(wait);
                assert!(!done(&mut wait).await);
                waiters.freed(R0);
                assert!(done(&mut wait).await);
            }
            let seen = waiters.frees();
            let r1_wait = for_r1.wait(&[R1], seen);
            let r0_wait = for_r0.wait(&[R0], seen);
            tokio::pin!(r1_wait, r0_wait);
            assert!(!done(&mut r1_wait).await && !done(&mut r0_wait).await);
            match placed_elsewhere {
                true => woken.placed(Some(R1)),
                false => drop(woken),
            }
            assert!(done(&mut r0_wait).await, "R0's room passed on");
            assert!(!done(&mut r1_wait).await, "R1 freed nothing");
        }
    }

    #[tokio::test]
    async fn a_request_placed_where_it_was_woken_for_passes_nothing_on() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let (mut placed, mut next) = (waiters.ticket(0), waiters.ticket(0));
        {
            let wait = placed.wait(&[R0], seen);
            tokio::pin!(wait);
            assert!(!done(&mut wait).await);
            waiters.freed(R0);
            assert!(done(&mut wait).await);
        }
        let next_wait = next.wait(&[R0], waiters.frees());
        tokio::pin!(next_wait);
        assert!(!done(&mut next_wait).await);
        placed.placed(Some(R0));
        assert!(!done(&mut next_wait).await, "nothing passed on");
    }

    /// The room that woke a request is held for it: taken by others' decisions, not by its
    /// own; let go when it is placed there, passed on when it leaves, freed when nobody
    /// waits for it.
    #[tokio::test]
    async fn the_room_that_woke_a_request_is_held_for_it() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let (mut woken, mut next) = (waiters.ticket(0), waiters.ticket(0));
        for ticket in [&mut woken, &mut next] {
            assert!(matches!(ticket.join(&[R0], seen), Joined::Waiting));
        }
        assert_eq!(waiters.held_for_others(R0), 0);
        waiters.freed(R0);
        assert_eq!(woken.holding(), Some(R0));
        assert_eq!(waiters.held_for_others(R0), 1, "held for the woken request");
        assert_eq!(holding(woken.hold(), async { waiters.held_for_others(R0) }).await, 0, "its own");
        assert_eq!(waiters.held_for_others(R1), 0);
        // It leaves: the room goes to the next, still held.
        drop(woken);
        assert_eq!(next.holding(), Some(R0));
        assert_eq!(waiters.held_for_others(R0), 1);
        // The next takes it: nothing held, nothing freed.
        let frees = waiters.frees();
        next.placed(Some(R0));
        assert_eq!((waiters.held_for_others(R0), waiters.frees()), (0, frees));
        // Woken, then placed elsewhere with nobody else waiting: the room is freed.
        let mut elsewhere = waiters.ticket(0);
        assert!(matches!(elsewhere.join(&[R0, R1], waiters.frees()), Joined::Waiting));
        waiters.freed(R0);
        let frees = waiters.frees();
        elsewhere.placed(Some(R1));
        assert_eq!(waiters.held_for_others(R0), 0);
        assert_ne!(waiters.frees(), frees, "freed");
        assert_eq!(waiters.holds.load(SeqCst), 0);
    }

    /// A woken request refused again because another took its room (the replica is over its
    /// limit) lets its hold go without passing it on: passed on, holds for rooms that do not
    /// exist would keep the replica saturated for the waiting requests, which would pass them
    /// to one another for ever.
    #[tokio::test]
    async fn a_hold_whose_room_was_taken_is_not_passed_on() {
        use super::super::upstream::{Ineligible, Upstream};
        let waiters = Arc::new(Waiters::default());
        let u = Arc::new(Upstream::waking(waiters.clone(), R0));
        let running = u.begin(1, 0, 0);
        let (mut first, mut second) = (waiters.ticket(0), waiters.ticket(0));
        let seen = waiters.frees();
        for ticket in [&mut first, &mut second] {
            assert!(matches!(ticket.join(&[R0], seen), Joined::Waiting));
        }
        drop(running);
        assert_eq!(first.holding(), Some(R0), "woken, its room held");
        first.state = State::Woken;
        // Another thread's request took the room just before the hold (over the limit).
        let newcomer = u.begin(1, 0, 0);
        let refused = holding(first.hold(), async { u.eligibility(1) }).await;
        assert_eq!(refused, Err(Ineligible::Saturated));
        // It lets the hold go, and decides again (refused again: there is no room), then waits.
        assert!(matches!(first.join(&[R0], waiters.frees()), Joined::Freed), "decides again");
        assert_eq!(waiters.held_for_others(R0), 0);
        assert_eq!(u.eligibility(1), Err(Ineligible::Saturated));
        assert!(matches!(first.join(&[R0], waiters.frees()), Joined::Waiting), "back in line");
        assert!(waiters.line().contains_key(&second.id), "no room to pass on");
        // The room comes back when the newcomer ends, to the first in line.
        drop(newcomer);
        assert_eq!(first.holding(), Some(R0));
        assert!(waiters.line().contains_key(&second.id));
    }

    /// A woken request refused again for another reason than room on the replica that woke
    /// it (that replica is draining, say, and it waits for others now) passes the room on to
    /// the next request waiting for it (a continuation whose owner it is takes it all the
    /// same).
    #[tokio::test]
    async fn a_hold_refused_for_another_reason_is_passed_on() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let (mut woken, mut next) = (waiters.ticket(0), waiters.ticket(0));
        assert!(matches!(woken.join(&[R0, R1], seen), Joined::Waiting));
        assert!(matches!(next.join(&[R0], seen), Joined::Waiting));
        waiters.freed(R0);
        assert_eq!(woken.holding(), Some(R0));
        woken.state = State::Woken;
        // Refused with only R1 saturated: it waits for R1 alone.
        let _ = woken.join(&[R1], waiters.frees());
        assert_eq!(next.holding(), Some(R0), "the room passed on");
        assert!(!waiters.line().contains_key(&next.id));
        assert_eq!(waiters.held_for_others(R0), 1);
    }

    #[tokio::test]
    async fn a_replica_back_wakes_everyone() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let (mut a, mut b) = (waiters.ticket(0), waiters.ticket(0));
        let a_wait = a.wait(&[R0], seen);
        let b_wait = b.wait(&[R1], seen);
        tokio::pin!(a_wait, b_wait);
        assert!(!done(&mut a_wait).await && !done(&mut b_wait).await);
        waiters.wake_all();
        assert!(done(&mut a_wait).await && done(&mut b_wait).await);
        assert_eq!(waiters.count.load(SeqCst), 0);
    }

    /// A request woken on one thread just as its client leaves on another passes the wake on
    /// to the next request waiting for that room, whichever comes first. (A race: run many
    /// times, on two threads released together.)
    #[test]
    fn a_wake_that_meets_its_request_leaving_is_passed_on() {
        for _ in 0..5_000 {
            let waiters = Waiters::default();
            let seen = waiters.frees();
            let (mut leaving, mut next) = (waiters.ticket(0), waiters.ticket(0));
            assert!(matches!(leaving.join(&[R1], seen), Joined::Waiting));
            assert!(matches!(next.join(&[R1], seen), Joined::Waiting));
            let start = std::sync::Barrier::new(2);
            std::thread::scope(|s| {
                s.spawn(|| {
                    start.wait();
                    waiters.freed(R1);
                });
                s.spawn(|| {
                    start.wait();
                    drop(leaving);
                });
            });
            assert!(!waiters.line().contains_key(&next.id), "the next request was not woken");
        }
    }

    /// A wait given up on (its future dropped) and taken again: in line once, and a wake
    /// that came between ends the new wait at once.
    #[tokio::test]
    async fn a_wait_taken_again_is_in_line_once() {
        let waiters = Waiters::default();
        let seen = waiters.frees();
        let mut ticket = waiters.ticket(0);
        for woken_between in [false, true] {
            {
                let wait = ticket.wait(&[R0], seen);
                tokio::pin!(wait);
                assert!(!done(&mut wait).await);
            }
            if woken_between {
                waiters.freed(R0);
            }
            let wait = ticket.wait(&[R0], waiters.frees());
            tokio::pin!(wait);
            assert_eq!(done(&mut wait).await, woken_between);
            assert_eq!(waiters.count.load(SeqCst), usize::from(!woken_between));
            assert_eq!(waiters.line().len(), usize::from(!woken_between));
        }
    }
}
