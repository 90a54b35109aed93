//! The HTTP client of the router's own requests to replicas: health checks and the load and
//! adapter listings they read, remote tokenization, the LoRA catch-up. (Proxied requests go
//! through each thread's [`super::pool::Pool`].)
//!
//! With `--replica-api-key`, each request carries it (`Authorization: Bearer <key>`, in place of
//! a client's), as the proxied ones to the paths the router guards do
//! ([`super::forward::upstream_head`]): replicas started with their own `--api-key` answer the
//! router, whatever keys its clients hold.

use std::time::Duration;

use http::header::{self, HeaderValue};
use hyper_util::client::legacy::{self, ResponseFuture, connect::HttpConnector};

use super::body::ProxyBody;
use super::live::Live;

/// How long an idle connection to a replica is kept for reuse, here and in the proxy's pools:
/// less than the replicas' servers keep one (uvicorn, under vLLM and SGLang, closes it after
/// 5 s), so that they rarely close one just as a request goes out on it.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// Most idle connections kept per replica (by each proxy thread's pool, and here).
pub const MAX_IDLE: usize = 1024;

/// Pooled keep-alive connections with a connect timeout, and the replicas' key. Clones share
/// the pool.
#[derive(Clone, Debug)]
pub struct Client {
    inner: legacy::Client<HttpConnector, ProxyBody>,
    authorization: Live<Option<HeaderValue>>,
}

impl Client {
    /// Connections made within `connect_timeout`; requests with `authorization` (the value of
    /// their `Authorization` field, as a reload leaves it) if any.
    pub fn new(connect_timeout: Duration, authorization: Live<Option<HeaderValue>>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        let inner = legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(IDLE_TIMEOUT)
            .pool_max_idle_per_host(MAX_IDLE)
            .build(connector);
        Self { inner, authorization }
    }

    /// Sends `request`, with the replicas' key in place of its own `Authorization`, if any.
    pub fn request(&self, mut request: http::Request<ProxyBody>) -> ResponseFuture {
        if let Some(authorization) = &*self.authorization.get() {
            request.headers_mut().insert(header::AUTHORIZATION, authorization.clone());
        }
        self.inner.request(request)
    }
}
