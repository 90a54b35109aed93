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

/// An idle deadline that counts from the start of each wait.
#[derive(Debug)]
pub struct IdleTimer {
    idle: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    /// The body is waiting and `sleep` holds this wait's deadline.
    waiting: bool,
}

impl IdleTimer {
    pub fn new(idle: Duration) -> Self {
        Self { idle, sleep: None, waiting: false }
    }

    pub fn idle(&self) -> Duration {
        self.idle
    }

    /// The body produced something: the next wait starts a new count.
    pub fn progress(&mut self) {
        self.waiting = false;
    }

    /// The body has nothing yet: ready once it has had nothing for the whole idle time,
    /// counted from the first of these calls since the last [`Self::progress`].
    pub fn poll_expired(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.waiting {
            self.waiting = true;
            let deadline = Instant::now() + self.idle;
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
}
