//! The HTTP client of the router's own requests to replicas: health checks and the load and
//! adapter listings they read, remote tokenization, the LoRA catch-up. (Proxied requests go
//! through each thread's [`super::pool::Pool`].)
//!
//! With `--replica-api-key`, each request carries it (`Authorization: Bearer <key>`, in place of
//! a client's), as the proxied ones to the paths the router guards do
//! ([`super::forward::upstream_head`]): replicas started with their own `--api-key` answer the
//! router, whatever keys its clients hold. `https://` replicas are reached with the proxy's TLS
//! ([`super::connect::ReplicaTls`]).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::header::{self, HeaderValue};
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::{self, ResponseFuture, connect::HttpConnector};
use tokio_rustls::rustls::ClientConfig;

use super::body::ProxyBody;
use super::connect::ReplicaTls;
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
    /// To `https://` replicas: made at the first request to one, and again when the TLS
    /// settings it was made with changed (at a reload, or of a change on disk).
    https: Arc<Mutex<Option<MadeWith>>>,
    tls: ReplicaTls,
    connect_timeout: Duration,
    authorization: Live<Option<HeaderValue>>,
}

impl Client {
    /// Connections made within `connect_timeout` (over `tls` to `https://` replicas); requests
    /// with `authorization` (the value of their `Authorization` field, as a reload leaves it)
    /// if any.
    pub fn new(connect_timeout: Duration, authorization: Live<Option<HeaderValue>>, tls: ReplicaTls) -> Self {
        let inner = pooled(connector(connect_timeout));
        Self { inner, https: Arc::default(), tls, connect_timeout, authorization }
    }

    /// Sends `request`, with the replicas' key in place of its own `Authorization`, if any.
    pub fn request(&self, mut request: http::Request<ProxyBody>) -> ResponseFuture {
        if let Some(authorization) = &*self.authorization.get() {
            request.headers_mut().insert(header::AUTHORIZATION, authorization.clone());
        }
        if request.uri().scheme() != Some(&http::uri::Scheme::HTTPS) {
            return self.inner.request(request);
        }
        self.https_client().request(request)
    }

    /// The client to `https://` replicas with the TLS settings in use.
    fn https_client(&self) -> HttpsClient {
        let config = self.tls.config();
        let mut https = self.https.lock().unwrap_or_else(PoisonError::into_inner);
        match &*https {
            Some((made_with, client)) if Arc::ptr_eq(made_with, &config) => client.clone(),
            _ => {
                let mut connector = connector(self.connect_timeout);
                connector.enforce_http(false);
                let builder =
                    HttpsConnectorBuilder::new().with_tls_config(ClientConfig::clone(&config)).https_only();
                let builder = match self.tls.server_name() {
                    Some(name) => {
                        builder.with_server_name_resolver(FixedServerNameResolver::new(name.clone()))
                    }
                    None => builder,
                };
                let client = pooled(builder.enable_http1().wrap_connector(connector));
                *https = Some((config, client.clone()));
                client
            }
        }
    }
}

type HttpsClient = legacy::Client<HttpsConnector<HttpConnector>, ProxyBody>;

/// A client to `https://` replicas, and the TLS settings it was made with.
type MadeWith = (Arc<ClientConfig>, HttpsClient);

/// TCP connections made within `timeout`, without Nagle's delay.
fn connector(timeout: Duration) -> HttpConnector {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(timeout));
    connector.set_nodelay(true);
    connector
}

/// A client keeping idle connections as the proxy's pools do.
fn pooled<C>(connector: C) -> legacy::Client<C, ProxyBody>
where
    C: legacy::connect::Connect + Clone,
{
    legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(IDLE_TIMEOUT)
        .pool_max_idle_per_host(MAX_IDLE)
        .build(connector)
}
