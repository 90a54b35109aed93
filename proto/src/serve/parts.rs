//! The tasks of one server (a router, a replica agent): spawned on one tracker, stopped by one
//! token, and stopped all together when one the server cannot run without fails.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};

use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A server's tasks. They stop on [`Parts::token`], a child of the caller's `shutdown`; a
/// part that fails cancels `shutdown` itself (stopping the server, and telling the caller),
/// as [`Parts::stop`] does. A start that fails [`Parts::abandon`]s what it had begun: its
/// tasks stop and the caller's token is left as it was.
#[derive(Clone, Debug)]
pub struct Parts {
    pub tracker: TaskTracker,
    /// The caller's token.
    pub shutdown: CancellationToken,
    token: CancellationToken,
    failure: Arc<OnceLock<String>>,
}

impl Parts {
    pub fn new(shutdown: CancellationToken) -> Self {
        let token = shutdown.child_token();
        Parts { tracker: TaskTracker::new(), shutdown, token, failure: Arc::default() }
    }

    /// The token the tasks go by.
    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Runs `part` as one of the tasks: if it fails, panics, or ends before the server's
    /// shutdown, the server stops, and [`Parts::failure`] says why.
    pub fn vital<F>(&self, what: impl Into<String>, part: F)
    where
        F: Future<Output = Result<(), String>> + Send + 'static,
    {
        let (parts, what) = (self.clone(), what.into());
        self.tracker.spawn(async move {
            let failed = match AssertUnwindSafe(part).catch_unwind().await {
                Ok(Err(e)) => e,
                Ok(Ok(())) if !parts.token.is_cancelled() => "stopped before the server did".into(),
                Ok(Ok(())) => return,
                Err(panic) => {
                    let why = panic.downcast_ref::<&str>().copied();
                    let why = why.or(panic.downcast_ref::<String>().map(String::as_str));
                    format!("panicked: {}", why.unwrap_or("(no message)"))
                }
            };
            tracing::error!(error = %failed, "{what} failed; the server stops");
            let _ = parts.failure.set(format!("{what}: {failed}"));
            parts.shutdown.cancel();
        });
    }

    /// Why the server stopped of itself, if it did: a vital part failed.
    pub fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    /// Stops every task and waits for them.
    pub async fn stop(&self) {
        self.shutdown.cancel();
        self.wait().await;
    }

    /// Stops the tasks of a start that failed, and waits for them; the caller's token is
    /// not cancelled.
    pub async fn abandon(&self) {
        self.token.cancel();
        self.wait().await;
    }

    async fn wait(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Runs `assemble` (a server's start) with new parts; if it fails, they are abandoned
    /// before the error returns.
    pub async fn start<T, E>(
        shutdown: CancellationToken,
        assemble: impl AsyncFnOnce(&Parts) -> Result<T, E>,
    ) -> Result<T, E> {
        let parts = Parts::new(shutdown);
        let started = assemble(&parts).await;
        if started.is_err() {
            parts.abandon().await;
        }
        started
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A part that panics, or ends before shutdown, stops the server and says why; one that
    /// ends at shutdown says nothing.
    #[tokio::test]
    async fn a_vital_part_that_panics_or_ends_stops_the_server() {
        let shutdown = CancellationToken::new();
        let parts = Parts::new(shutdown.clone());
        parts.vital("a part", async { panic!("at the disco") });
        parts.wait().await;
        assert!(shutdown.is_cancelled());
        assert_eq!(parts.failure(), Some("a part: panicked: at the disco"));

        let parts = Parts::new(CancellationToken::new());
        parts.vital("a part", async { Ok(()) });
        parts.wait().await;
        assert!(parts.shutdown.is_cancelled());
        assert_eq!(parts.failure(), Some("a part: stopped before the server did"));

        let parts = Parts::new(CancellationToken::new());
        let token = parts.token().clone();
        parts.vital("a part", async move {
            token.cancelled().await;
            Ok(())
        });
        parts.stop().await;
        assert_eq!(parts.failure(), None);
    }

    /// A start that fails stops what it began and leaves the caller's token alone.
    #[tokio::test]
    async fn a_start_that_fails_is_abandoned() {
        let shutdown = CancellationToken::new();
        let (began, ended) = (CancellationToken::new(), CancellationToken::new());
        let failed = Parts::start(shutdown.clone(), async |parts: &Parts| {
            let (token, begins, ended) = (parts.token().clone(), began.clone(), ended.clone());
            parts.tracker.spawn(async move {
                begins.cancel();
                token.cancelled().await;
                ended.cancel();
            });
            began.cancelled().await;
            Err::<(), _>("the port is taken")
        })
        .await;
        assert_eq!(failed, Err("the port is taken"));
        assert!(ended.is_cancelled(), "the task began was waited for");
        assert!(!shutdown.is_cancelled());
    }
}
