//! HTTP/2 responses a client stopped taking.
//!
//! A response body is polled only while its client takes data. An HTTP/2 client that
//! withholds window updates leaves its stream without capacity, and hyper stops polling the
//! body, while the connection as a whole goes on (the client reads its socket, so no write
//! waits and the server's send timeout, [`kvroute_proto::serve::send_timeout`], which
//! closes HTTP/1 connections whose writes wait, never fires). Whatever the body holds is
//! then held for as long as the client likes: the upstream connection (the replica keeps
//! the request) and the request's share of the replica's load (the router routes around a
//! replica that is not busy). The body's own idle timer cannot help; it is armed only by a
//! poll.
//!
//! So an HTTP/2 body that handed a frame to hyper and is not asked for the next one within
//! the send timeout is cut from outside: [`StallWatch`] looks at the bodies it was given
//! every quarter of the timeout (at most every second), and a stalled one drops its upstream
//! connection (the replica sees its client gone and stops) and releases its load. The client
//! is not told: hyper still waits for the stream's window, and the stream, with the frame
//! it holds, stays until the client opens the window (then it gets a reset) or goes away. A
//! client that reads slowly but steadily opens its window as it reads and is not cut, unless
//! it takes longer than the timeout to read what the window allowed.
//!
//! A body that is waiting on the replica is not the watch's business: its own idle timer
//! covers that. Answers of known length end with their one frame and are never watched;
//! a body is handed over only once it has passed a frame and is still open.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::time::Instant;

/// Something the watch looks at.
pub trait Watched: Send + Sync {
    /// Cuts the body if it has waited for its client since `since` or before, and says what
    /// it found.
    fn check(&self, since: Instant) -> Watch;
}

/// What a check found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watch {
    /// Still open and moving (or waiting on its replica).
    Keep,
    /// Over: nothing to watch.
    Ended,
    /// Its client stopped taking data: cut now.
    Cut,
}

/// Watches response bodies for clients that stopped taking data.
pub struct StallWatch {
    limit: Duration,
    bodies: Mutex<Vec<Weak<dyn Watched>>>,
    /// Bodies cut.
    stalls: Counter,
}

impl std::fmt::Debug for StallWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StallWatch").field("limit", &self.limit).finish_non_exhaustive()
    }
}

impl StallWatch {
    /// A watch that cuts bodies whose client took nothing for `limit`, counting them in
    /// `stalls`; it looks every quarter of `limit` (at least every 10 ms, at most every
    /// second) on a task of the current runtime, for as long as the watch lives.
    pub fn start(limit: Duration, stalls: Counter) -> Arc<Self> {
        let watch = Arc::new(Self { limit, bodies: Mutex::default(), stalls });
        let every = (limit / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let weak = Arc::downgrade(&watch);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                match weak.upgrade() {
                    Some(watch) => watch.sweep(Instant::now()),
                    None => return,
                }
            }
        });
        watch
    }

    /// Watches `body` from now on.
    pub fn watch(&self, body: Weak<dyn Watched>) {
        self.lock().push(body);
    }

    /// Bodies being watched.
    pub fn watching(&self) -> usize {
        self.lock().len()
    }

    /// Looks at every body once, as of `now`; bodies given meanwhile wait for the next look.
    pub fn sweep(&self, now: Instant) {
        // Before the clock could run `limit`, nothing can have waited that long.
        let Some(since) = now.checked_sub(self.limit) else { return };
        let mut bodies = std::mem::take(&mut *self.lock());
        bodies.retain(|body| {
            let Some(body) = body.upgrade() else { return false };
            match body.check(since) {
                Watch::Keep => true,
                Watch::Ended => false,
                Watch::Cut => {
                    self.stalls.inc();
                    false
                }
            }
        });
        self.lock().append(&mut bodies);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Weak<dyn Watched>>> {
        self.bodies.lock().unwrap_or_else(|e| e.into_inner())
    }
}
