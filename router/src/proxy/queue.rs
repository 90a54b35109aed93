//! Waiting for room. A request that finds the router at `--max-in-flight`, or every replica
//! it could go to at `--max-in-flight-per-replica`, waits in line for room instead of getting
//! 503 at once: a burst past the fleet's capacity is served a little later rather than
//! refused (and retried by every client at once).
//!
//! - A request waits up to `--queue-timeout-ms` in all (its waits for a place and for a
//!   replica together; reading its body between them does not count); then it gets 503. At most `--max-queued` requests wait at once: one more gets 503 at once.
//!   With either set to 0, nothing waits.
//! - Places under `--max-in-flight` go first come, first served (its semaphore is fair),
//!   whatever their priority (taken before the body, which says it, is read). A request
//!   keeps its place while it waits for a replica.
//! - A request waiting for a replica is woken as [`Waiters`] says (by its `priority`, vLLM's
//!   request field, lower first; then the longest waiting for the replica, when a request to
//!   it ends) and decides again on the fleet, index,
//!   credits and load as they are then (tokenized once: [`super::route::Prepared`]; each
//!   decision shows in `decision_seconds`). The room that woke it is held for it meanwhile:
//!   a request that arrives then waits behind it ([`Waiters`]). `priority` is the client's to
//!   set (as vLLM's is): a steady stream of lower values keeps higher ones waiting until
//!   their time is up. It is read from completion, chat and Responses bodies, continuations
//!   included (Messages requests, which have none, wait at 0); a replica without
//!   priority scheduling answers any but 0 with 400, as vLLM does.
//! - A Responses continuation, which only the replica that stored its response can serve,
//!   waits for room there.
//! - Only want of room waits: a fleet with no healthy replica answers 503 at once.
//! - A retry whose replicas left to try are all saturated waits for room on one of them
//!   ([`super::forward`]): a replica that refuses connections (it died, and no health check
//!   has noticed yet) or answers 503 (its own queue is full) while the rest of the fleet is
//!   busy costs its requests a wait, not a 502 or a 503.
//! - A request whose client leaves while it waits leaves the line (one decided apart from its
//!   client, a background response's, as soon as the client is gone: [`Line::follow`]).
//!
//! The line shows in `kvroute_router_queued` (waiting now), `kvroute_router_queue_wait_seconds`
//! and `kvroute_router_queue_outcomes_total` (a wait each: a request that waited for a place
//! under `--max-in-flight`, then for a replica, then for a retry's counts three times).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::error::ProxyError;
use super::forward::Slot;
use super::waiters::{Ticket, Waiters};
use crate::metrics::{OutcomeLabel, ProxyMetrics};
use kvroute_proto::ReplicaId;

/// Why a request at `--max-in-flight` waits (and what its 503 says).
const AT_LIMIT: &str = "the router is at its in-flight limit";

/// The line of requests waiting for room.
#[derive(Debug)]
pub struct Queue {
    /// How long a request may wait in all; `None`: none waits.
    timeout: Option<Duration>,
    max: usize,
    waiting: AtomicUsize,
}

/// A request's time in line so far: its waits together are bounded by the timeout (reading
/// its body, or finding a response's owner, between them does not count). And its priority
/// among those waiting for a replica's room, once its body is read.
#[derive(Debug, Default)]
pub struct Line {
    /// Nanoseconds.
    waited: AtomicU64,
    priority: AtomicI64,
    /// Its place among those waiting for a replica's room, from its first wait on
    /// ([`Waiters::ticket_kept`]): a retry that waits again keeps its turn.
    place: AtomicU64,
    /// Fires when the client left, for a request decided apart from it ([`Line::follow`]).
    gone: Option<CancellationToken>,
}

impl Line {
    fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited.load(Ordering::Relaxed))
    }

    /// The request's `priority` (lower waits less; 0 unless set).
    pub fn set_priority(&self, priority: i64) {
        self.priority.store(priority, Ordering::Relaxed);
    }

    /// Leaves the line when `gone` fires (its client left), for a request decided apart from
    /// its client: a wait for a replica's room ends then ([`ProxyError::ClientLeft`]), as the
    /// request's own would with its client.
    pub fn follow(&mut self, gone: CancellationToken) {
        self.gone = Some(gone);
    }

    /// Fires when the client left, if followed; else never.
    async fn left(&self) {
        match &self.gone {
            Some(gone) => gone.cancelled().await,
            None => std::future::pending().await,
        }
    }
}

impl Queue {
    /// A line of at most `max` requests, each waiting at most `timeout` (`None`: none waits).
    pub fn new(max: usize, timeout: Option<Duration>) -> Self {
        Self { timeout: timeout.filter(|_| max > 0), max, waiting: AtomicUsize::new(0) }
    }

    /// Whether requests wait in line at all (`--max-queued` and `--queue-timeout-ms` above 0).
    pub fn waits(&self) -> bool {
        self.timeout.is_some()
    }

    /// A place under `limit` (`--max-in-flight`), waiting in `line` for one if none is free.
    pub async fn admit(
        &self,
        limit: &Arc<Semaphore>,
        line: &Line,
        metrics: &ProxyMetrics,
    ) -> Result<Slot, ProxyError> {
        if let Some(slot) = Slot::try_take(limit, &metrics.in_flight) {
            return Ok(slot);
        }
        let waiting = self.join(line, AT_LIMIT, metrics)?;
        // The semaphore is never closed.
        match tokio::time::timeout_at(waiting.deadline, limit.clone().acquire_owned()).await {
            Ok(Ok(permit)) => Ok(waiting.end("placed", Slot::with(permit, &metrics.in_flight))),
            _ => Err(waiting.timed_out(AT_LIMIT)),
        }
    }

    /// What `attempt` comes to, tried again whenever one of the replicas that refused it for
    /// want of room ([`ProxyError::Saturated`]) may have room ([`Waiters`]), for as long as
    /// `line`'s time is not up; `goes_to` tells which replica an outcome takes room on.
    pub async fn until_room<T, F, Fut>(
        &self,
        waiters: &Waiters,
        (line, metrics): (&Line, &ProxyMetrics),
        mut attempt: F,
        goes_to: impl Fn(&T) -> Option<ReplicaId>,
    ) -> Result<T, ProxyError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ProxyError>>,
    {
        let mut waiting: Option<(Waiting<'_>, Ticket<'_>)> = None;
        loop {
            let seen = waiters.frees();
            // A woken request decides with the room that woke it held for it.
            let holding = waiting.as_ref().and_then(|(_, ticket)| ticket.hold());
            // (Called inside the scope: a decision may be made when `attempt` is called.)
            match super::waiters::holding(holding, async { attempt().await }).await {
                Err(ProxyError::Saturated { reason, replicas }) => {
                    let (at, ticket) = match &mut waiting {
                        Some(waiting) => waiting,
                        None => {
                            let priority = line.priority.load(Ordering::Relaxed);
                            let ticket = waiters.ticket_kept(priority, &line.place);
                            waiting.insert((self.join(line, &reason, metrics)?, ticket))
                        }
                    };
                    let waited = tokio::time::timeout_at(at.deadline, ticket.wait(&replicas, seen));
                    let waited = tokio::select! {
                        waited = waited => waited,
                        () = line.left() => return Err(ProxyError::ClientLeft),
                    };
                    if waited.is_err() {
                        let (at, _) = waiting.take().expect("in line");
                        return Err(at.timed_out(&reason));
                    }
                }
                done => {
                    let Some((at, ticket)) = waiting else { return done };
                    return match done {
                        Ok(placed) => {
                            ticket.placed(goes_to(&placed));
                            Ok(at.end("placed", placed))
                        }
                        Err(e) => Err(at.end("refused", e)),
                    };
                }
            }
        }
    }

    /// A place in line for a request refused for want of room (`why`), or its 503.
    fn join<'a>(
        &'a self,
        line: &'a Line,
        why: &str,
        metrics: &'a ProxyMetrics,
    ) -> Result<Waiting<'a>, ProxyError> {
        let saturated = |reason: String| ProxyError::Saturated { reason, replicas: Vec::new() };
        let Some(timeout) = self.timeout else { return Err(saturated(why.to_owned())) };
        let taken = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < self.max).then_some(n + 1));
        if taken.is_err() {
            count(metrics, "full");
            return Err(saturated(format!("{why}, and {} requests wait already", self.max)));
        }
        metrics.queued.inc();
        let now = Instant::now();
        let deadline = now + timeout.saturating_sub(line.waited());
        Ok(Waiting { queue: self, line, metrics, since: now, deadline, outcome: "left" })
    }
}

fn count(metrics: &ProxyMetrics, outcome: &'static str) {
    metrics.queue_outcomes.get_or_create(&OutcomeLabel { outcome }).inc();
}

/// A request in line; leaving it (dropped) counts its wait, with its outcome.
struct Waiting<'a> {
    queue: &'a Queue,
    line: &'a Line,
    metrics: &'a ProxyMetrics,
    since: Instant,
    deadline: Instant,
    /// Until the wait ends otherwise: the client left (this future was dropped).
    outcome: &'static str,
}

impl Waiting<'_> {
    /// The wait ended with `outcome`, coming to `value`.
    fn end<T>(mut self, outcome: &'static str, value: T) -> T {
        self.outcome = outcome;
        value
    }

    /// The 503 of a request whose time in line is up.
    fn timed_out(mut self, why: &str) -> ProxyError {
        self.outcome = "timed_out";
        let waited = (self.line.waited() + self.since.elapsed()).as_millis();
        let reason = format!("{why}; waited {waited} ms in line for room");
        ProxyError::Saturated { reason, replicas: Vec::new() }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.queue.waiting.fetch_sub(1, Ordering::AcqRel);
        self.metrics.queued.dec();
        let waited = self.since.elapsed();
        let nanos = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.line.waited.fetch_add(nanos, Ordering::Relaxed);
        self.metrics.queue_wait_seconds.observe(waited.as_secs_f64());
        count(self.metrics, self.outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics() -> ProxyMetrics {
        ProxyMetrics::default()
    }

    fn outcome(metrics: &ProxyMetrics, outcome: &'static str) -> u64 {
        metrics.queue_outcomes.get_or_create(&OutcomeLabel { outcome }).get()
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_at_the_limit_gets_the_first_place_freed() {
        let (queue, metrics, limit) =
            (Queue::new(4, Some(Duration::from_secs(5))), metrics(), Arc::new(Semaphore::new(1)));
        let held = queue.admit(&limit, &Line::default(), &metrics).await.unwrap();
        let line = Line::default();
        let waiting = queue.admit(&limit, &line, &metrics);
        tokio::pin!(waiting);
        assert!(futures::poll!(&mut waiting).is_pending(), "no place free");
        assert_eq!(metrics.queued.get(), 1);
        drop(held);
        let _slot = waiting.await.expect("the freed place");
        assert_eq!((metrics.queued.get(), outcome(&metrics, "placed")), (0, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waits_no_longer_than_its_time_in_line() {
        let (queue, metrics, limit) =
            (Queue::new(4, Some(Duration::from_secs(5))), metrics(), Arc::new(Semaphore::new(1)));
        let _held = queue.admit(&limit, &Line::default(), &metrics).await.unwrap();
        let started = Instant::now();
        let refused = queue.admit(&limit, &Line::default(), &metrics).await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(
            matches!(&refused, ProxyError::Saturated { reason, .. } if reason.contains("waited 5000 ms")),
            "{refused}"
        );
        assert_eq!((metrics.queued.get(), outcome(&metrics, "timed_out")), (0, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_line_or_no_line_refuses_at_once() {
        let limit = Arc::new(Semaphore::new(0));
        for queue in [Queue::new(0, Some(Duration::from_secs(5))), Queue::new(4, None)] {
            let started = Instant::now();
            let refused = queue.admit(&limit, &Line::default(), &metrics()).await.unwrap_err();
            assert!(matches!(refused, ProxyError::Saturated { .. }));
            assert_eq!(started.elapsed(), Duration::ZERO);
        }
        let (queue, metrics) = (Queue::new(1, Some(Duration::from_secs(5))), metrics());
        let line = Line::default();
        let first = queue.admit(&limit, &line, &metrics);
        tokio::pin!(first);
        assert!(futures::poll!(&mut first).is_pending());
        let refused = queue.admit(&limit, &Line::default(), &metrics).await.unwrap_err();
        assert!(refused.to_string().contains("1 requests wait already"), "{refused}");
        assert_eq!(outcome(&metrics, "full"), 1);
    }

    fn saturated() -> ProxyError {
        ProxyError::Saturated { reason: "every replica is saturated".into(), replicas: vec![ReplicaId(0)] }
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_waiting_for_a_replica_tries_again_when_it_has_room() {
        let (queue, metrics, waiters) =
            (Queue::new(4, Some(Duration::from_secs(5))), metrics(), Waiters::default());
        let room = std::sync::atomic::AtomicBool::new(false);
        let mut tries = 0;
        let attempt = || {
            tries += 1;
            let answer = match room.load(Ordering::Relaxed) {
                true => Ok(tries),
                false => Err(saturated()),
            };
            std::future::ready(answer)
        };
        let line = Line::default();
        let waiting = queue.until_room(&waiters, (&line, &metrics), attempt, |_| Some(ReplicaId(0)));
        tokio::pin!(waiting);
        assert!(futures::poll!(&mut waiting).is_pending());
        tokio::time::advance(Duration::from_secs(4)).await;
        assert!(futures::poll!(&mut waiting).is_pending(), "nothing freed: no second try");
        waiters.freed(ReplicaId(1));
        assert!(futures::poll!(&mut waiting).is_pending(), "another replica's room");
        room.store(true, Ordering::Relaxed);
        waiters.freed(ReplicaId(0));
        assert_eq!(waiting.await.unwrap(), 2, "tried again once, when its replica had room");
        assert_eq!(outcome(&metrics, "placed"), 1);
    }

    /// A request that waits again (a retry, its replica failed) keeps its turn: the room freed
    /// next is tried by it, not by a request that came after its first wait. (It took a new
    /// place, behind everything that came meanwhile.)
    #[tokio::test(start_paused = true)]
    async fn a_retry_keeps_its_turn_in_line() {
        use std::sync::atomic::AtomicU32;
        let (queue, metrics, waiters) =
            (Queue::new(4, Some(Duration::from_secs(60))), metrics(), Waiters::default());
        let (a, b) = (Line::default(), Line::default());
        let room = std::sync::atomic::AtomicBool::new(false);
        let (a_tries, b_tries) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let attempt = |tries: &Arc<AtomicU32>| {
            let (room, tries) = (&room, tries.clone());
            move || {
                tries.fetch_add(1, Ordering::Relaxed);
                std::future::ready(match room.load(Ordering::Relaxed) {
                    true => Ok(()),
                    false => Err(saturated()),
                })
            }
        };
        // A waits first, and is placed.
        {
            let first = queue.until_room(&waiters, (&a, &metrics), attempt(&a_tries), |_| Some(ReplicaId(0)));
            tokio::pin!(first);
            assert!(futures::poll!(&mut first).is_pending());
            room.store(true, Ordering::Relaxed);
            waiters.freed(ReplicaId(0));
            first.await.unwrap();
            room.store(false, Ordering::Relaxed);
        }
        // B comes, then A's retry: both wait.
        let b_wait = queue.until_room(&waiters, (&b, &metrics), attempt(&b_tries), |_| Some(ReplicaId(0)));
        let a_retry = queue.until_room(&waiters, (&a, &metrics), attempt(&a_tries), |_| Some(ReplicaId(0)));
        tokio::pin!(b_wait, a_retry);
        assert!(futures::poll!(&mut b_wait).is_pending() && futures::poll!(&mut a_retry).is_pending());
        let (a_before, b_before) = (a_tries.load(Ordering::Relaxed), b_tries.load(Ordering::Relaxed));
        waiters.freed(ReplicaId(0));
        assert!(futures::poll!(&mut b_wait).is_pending() && futures::poll!(&mut a_retry).is_pending());
        assert_eq!(
            (a_tries.load(Ordering::Relaxed) - a_before, b_tries.load(Ordering::Relaxed) - b_before),
            (1, 0),
            "the room went to A's retry first"
        );
    }

    /// A request's waits together last `--queue-timeout-ms` at most, the time between them
    /// (its body read) not counted.
    #[tokio::test(start_paused = true)]
    async fn a_request_waits_its_time_in_line_in_all() {
        let (queue, metrics, waiters) =
            (Queue::new(4, Some(Duration::from_secs(5))), metrics(), Waiters::default());
        let limit = Arc::new(Semaphore::new(0));
        let line = Line::default();
        let _slot = {
            let at_limit = queue.admit(&limit, &line, &metrics);
            tokio::pin!(at_limit);
            assert!(futures::poll!(&mut at_limit).is_pending());
            tokio::time::advance(Duration::from_secs(3)).await;
            limit.add_permits(1);
            at_limit.await.unwrap()
        };
        // Its body takes long to come: not time in line.
        tokio::time::advance(Duration::from_secs(10)).await;
        let started = Instant::now();
        let saturated = || std::future::ready(Err::<(), _>(saturated()));
        let refused = queue.until_room(&waiters, (&line, &metrics), saturated, |_| None).await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(2), "what was left of its 5 s");
        assert!(refused.to_string().contains("waited 5000 ms in line"), "{refused}");
        assert_eq!((outcome(&metrics, "placed"), outcome(&metrics, "timed_out")), (1, 1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_whose_client_left_leaves_the_line() {
        let (queue, metrics, limit) =
            (Queue::new(1, Some(Duration::from_secs(5))), metrics(), Arc::new(Semaphore::new(0)));
        {
            let line = Line::default();
            let left = queue.admit(&limit, &line, &metrics);
            tokio::pin!(left);
            assert!(futures::poll!(&mut left).is_pending());
        }
        assert_eq!((metrics.queued.get(), outcome(&metrics, "left")), (0, 1));
        let line = Line::default();
        let next = queue.admit(&limit, &line, &metrics);
        tokio::pin!(next);
        assert!(futures::poll!(&mut next).is_pending(), "its place in line is free again");
    }
}
