//! [`IdleTimer`]: the idle timeout of a body, armed only while the body waits.
//!
//! Most bodies the proxy passes on never wait: a small request body arrives with its head, a
//! small response with its head. So the timer is made on the first wait and re-armed on the
//! first wait after each frame, never on a frame itself: making a tokio timer reads the
//! clock and allocates, and re-arming one takes the timer wheel's lock (both showed in
//! profiles of the proxy under load, as much as the rest of the body's work).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// An idle deadline that counts from the start of each wait; the wait for the first frame
/// may have a later deadline of its own ([`Self::first_by`]).
#[derive(Debug)]
pub struct IdleTimer {
    idle: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    /// The body is waiting and `sleep` holds this wait's deadline.
    waiting: bool,
    /// Until the first frame, a wait lasts at least until then.
    first_by: Option<Instant>,
    /// How long the current wait may last.
    limit: Duration,
}

impl IdleTimer {
    pub fn new(idle: Duration) -> Self {
        Self { idle, sleep: None, waiting: false, first_by: None, limit: idle }
    }

    /// Lets the wait for the first frame last until `deadline` if that is later than the
    /// idle time: a streamed answer's head comes at once, its first event after the
    /// request's queueing and prefill, which the first-byte timeout bounds.
    pub fn first_by(mut self, deadline: Instant) -> Self {
        self.first_by = Some(deadline);
        self
    }

    /// How long the current (or next) wait may last.
    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// The body produced something: the next wait starts a new count.
    pub fn progress(&mut self) {
        self.waiting = false;
        self.first_by = None;
    }

    /// The body produced something that is not yet its output (a Responses stream's opening
    /// events): the next wait starts a new count, and still lasts until the first deadline.
    pub fn opening(&mut self) {
        self.waiting = false;
    }

    /// The body has nothing yet: ready once it has had nothing for the whole idle time,
    /// counted from the first of these calls since the last [`Self::progress`] or
    /// [`Self::opening`] (and, before the first output, not before the first deadline).
    pub fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.waiting {
            self.waiting = true;
            let now = Instant::now();
            let deadline = (now + self.idle).max(self.first_by.unwrap_or(now));
            self.limit = deadline - now;
            match &mut self.sleep {
                Some(sleep) => sleep.as_mut().reset(deadline),
                None => self.sleep = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        self.sleep.as_mut().map_or(Poll::Pending, |sleep| sleep.as_mut().poll(cx))
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_count_starts_at_the_first_wait_and_again_after_progress() {
        let mut timer = IdleTimer::new(Duration::from_secs(1));
        // Time before the first wait does not count.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let started = Instant::now();
        poll_fn(|cx| timer.poll_expired(cx)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        // Still expired until something comes.
        assert!(poll_fn(|cx| Poll::Ready(timer.poll_expired(cx).is_ready())).await);
        timer.progress();
        tokio::time::sleep(Duration::from_secs(3)).await;
        let started = Instant::now();
        poll_fn(|cx| timer.poll_expired(cx)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }

    /// The wait for the first frame lasts until the first deadline (if later); the waits
    /// after a frame, the idle time.
    #[tokio::test(start_paused = true)]
    async fn the_first_wait_lasts_until_the_first_deadline() {
        let started = Instant::now();
        let mut timer = IdleTimer::new(Duration::from_secs(1)).first_by(started + Duration::from_secs(10));
        tokio::time::sleep(Duration::from_secs(2)).await;
        poll_fn(|cx| timer.poll_expired(cx)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert_eq!(timer.limit(), Duration::from_secs(8));
        timer.progress();
        let waited = Instant::now();
        poll_fn(|cx| timer.poll_expired(cx)).await;
        assert_eq!(waited.elapsed(), Duration::from_secs(1));
        // A first deadline already past leaves the idle time.
        let mut late = IdleTimer::new(Duration::from_secs(1)).first_by(started);
        let waited = Instant::now();
        poll_fn(|cx| late.poll_expired(cx)).await;
        assert_eq!(waited.elapsed(), Duration::from_secs(1));
    }
}
