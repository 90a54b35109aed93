//! The access log (`--access-log`): one line a request, at `INFO` under the target
//! `kvroute_router::access`, through the process's log output (`KVROUTE_LOG_FORMAT=json`
//! makes each one a JSON object).
//!
//! A forwarded request is logged when its response ends, so the line has what only the end
//! shows: how it ended and the cached tokens the replica reported (`cached_tokens`, absent
//! when its response had no `usage`) beside the router's prediction. A request the router
//! answered itself with an error is logged with that error.
//!
//! Fields: `request_id`, `client` (the address the connection came from: a load balancer's,
//! if one is in front; its `X-Forwarded-For` reaches the replicas), `method`, `path` (no
//! query), `status`, `replica`, `attempt` (1 for the first replica tried), `model`,
//! `prompt_tokens` and `predicted_cached_tokens` (routed requests),
//! `cached_tokens`, `end` (`complete`, `failed`: the replica broke off, `abandoned`: the
//! client left, before its answer began too: status 499), `ttfb_ms` (from the request's
//! arrival to the response's first data), `duration_ms`; for an error the router answered,
//! `error` and, when a replica failed, `replica`.

use std::net::SocketAddr;
use std::sync::Arc;

use http::Method;
use tokio::time::Instant;
use tracing::field::{DisplayValue, display};

use super::body::End;
use super::error::ProxyError;
use crate::metrics::ProxyMetrics;

/// Where the log lines go.
pub const TARGET: &str = "kvroute_router::access";

/// When a request arrived, and where from: what its line starts with (taken only while the
/// log is on: a clock read is not free).
#[derive(Clone, Copy, Debug)]
pub struct Arrival {
    pub at: Instant,
    /// The connection's peer (`None` for a request that did not come over a socket).
    pub client: Option<SocketAddr>,
}

impl Arrival {
    fn client(&self) -> Option<DisplayValue<SocketAddr>> {
        self.client.map(display)
    }
}

/// What a forwarded request's line says, gathered on its way.
pub struct Line {
    pub request_id: String,
    pub method: Method,
    pub path: String,
    pub replica: String,
    pub status: u16,
    /// 0 for the first replica tried.
    pub attempt: usize,
    /// Known for a routed request only.
    pub model: Option<Arc<str>>,
    pub prompt_tokens: Option<u64>,
    pub predicted_cached_tokens: Option<u64>,
    /// `prefill` for a prefill sent ahead of its request, `decode` for the request decoded
    /// after it ([`super::disagg`]).
    pub hop: Option<&'static str>,
    pub received: Arrival,
    pub first_data: Option<Instant>,
}

impl Line {
    /// The line of `admitted`, a `method` request for `uri`; the rest is filled in on the
    /// way.
    pub fn new(admitted: &super::forward::Admitted<'_>, method: &Method, uri: &http::Uri) -> Self {
        Self {
            request_id: admitted.request_id.to_owned(),
            method: method.clone(),
            path: uri.path().to_owned(),
            replica: String::new(),
            status: 0,
            attempt: 0,
            model: None,
            prompt_tokens: None,
            predicted_cached_tokens: None,
            hop: None,
            received: admitted.received.unwrap_or_else(|| Arrival { at: Instant::now(), client: None }),
            first_data: None,
        }
    }

    /// Logs the line of a response that ended as `end`.
    pub fn finish(self, end: End, cached_tokens: Option<u64>) {
        let end = match end {
            End::Complete => "complete",
            End::Failed => "failed",
            End::Abandoned => "abandoned",
        };
        let ttfb_ms = self.first_data.map(|at| millis(at.duration_since(self.received.at)));
        tracing::info!(
            target: TARGET,
            request_id = self.request_id,
            client = self.received.client(),
            method = %self.method,
            path = self.path,
            status = self.status,
            replica = self.replica,
            attempt = self.attempt + 1,
            model = self.model.as_deref(),
            prompt_tokens = self.prompt_tokens,
            predicted_cached_tokens = self.predicted_cached_tokens,
            hop = self.hop,
            cached_tokens,
            end,
            ttfb_ms,
            duration_ms = millis(self.received.at.elapsed()),
            "request"
        );
    }
}

/// A request on its way to an answer: logged as `abandoned` (status 499, as nginx writes a
/// client that closed first) if it is dropped before [`Unanswered::answered`], and counted
/// so in `requests_total`.
pub struct Unanswered<'a> {
    line: Option<(&'a str, &'a (Method, String), Arrival)>,
    counted: Option<&'a ProxyMetrics>,
}

impl<'a> Unanswered<'a> {
    /// For the request `request_id`, logged when the access log is on (`asked` and
    /// `received` are known then), counted in `metrics` if given.
    pub fn new(
        request_id: &'a str,
        asked: Option<&'a (Method, String)>,
        received: Option<Arrival>,
        metrics: Option<&'a ProxyMetrics>,
    ) -> Self {
        Self {
            line: asked.zip(received).map(|(asked, received)| (request_id, asked, received)),
            counted: metrics,
        }
    }

    /// The request has its answer (or error): its line and count are someone else's.
    pub fn answered(&mut self) {
        self.line = None;
        self.counted = None;
    }
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(metrics) = self.counted.take() {
            metrics.count_response(499);
        }
        if let Some((request_id, (method, path), received)) = self.line.take() {
            tracing::info!(
                target: TARGET,
                request_id,
                client = received.client(),
                method = %method,
                path,
                status = 499,
                end = "abandoned",
                duration_ms = millis(received.at.elapsed()),
                "request"
            );
        }
    }
}

/// Logs a request the router answered itself with `error`.
pub fn refused(request_id: &str, method: &Method, path: &str, received: Arrival, error: &ProxyError) {
    tracing::info!(
        target: TARGET,
        request_id,
        client = received.client(),
        method = %method,
        path,
        status = error.status().as_u16(),
        error = error.label(),
        replica = error.replica(),
        duration_ms = millis(received.at.elapsed()),
        "request"
    );
}

/// Milliseconds, to the microsecond.
fn millis(d: std::time::Duration) -> f64 {
    d.as_micros() as f64 / 1e3
}
