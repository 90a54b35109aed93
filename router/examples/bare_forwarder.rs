//! The floor of the proxy comparison (`router/benches/proxy_vs_nginx.sh`): the router's own
//! HTTP plumbing with nothing between its two sides.
//!
//! Requests are served by the router's accept loop (`kvroute_proto::serve`, one thread and
//! listening socket per core, hyper's server) and sent round-robin through the router's
//! upstream pool (`kvroute_router::proxy::pool`); the body is read whole first, as the router
//! reads a routed request's, and the exchange's future is boxed, as the router's is; the
//! allocator is the router's. Nothing else: no decision, no load accounting, no timeouts
//! but the server's and the pool's connect timeout, no metrics, no usage sniffing, headers
//! passed as they are but `Host`. What kvroute-router costs beyond this is what its routing
//! costs. (Built as an example, it has the dev-dependencies' features too: tokio's
//! `test-util` takes a few more locks when a thread parks, so the floor is a little high.)
//!
//! Usage: `cargo run --release -p kvroute-router --example bare_forwarder -- LISTEN THREADS
//! URL...` (e.g. `127.0.0.1:8080 2 http://127.0.0.1:8001 http://127.0.0.1:8002`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use kvroute_proto::serve::{Heartbeats, Limits, serve_on_threads};
use kvroute_router::proxy::body::ProxyBody;
use kvroute_router::proxy::http1::Outgoing;
use kvroute_router::proxy::pool::Pool;
use tokio_util::sync::CancellationToken;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, threads, urls @ ..] = args.as_slice() else {
        bail!("usage: bare_forwarder LISTEN THREADS URL...");
    };
    let threads: usize = threads.parse().context("THREADS must be a number")?;
    if urls.is_empty() || urls.iter().any(|u| !u.starts_with("http://")) {
        bail!("give one http:// URL or more to forward to");
    }
    let urls: Arc<[String]> = urls.iter().map(|u| u.trim_end_matches('/').to_owned()).collect();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        let listener =
            tokio::net::TcpListener::bind(listen).await.with_context(|| format!("binding {listen}"))?;
        let next = Arc::new(AtomicUsize::new(0));
        let make_handler = || {
            let pool = Arc::new(Pool::new(Duration::from_secs(5), Duration::from_secs(4), 1024));
            let (urls, next) = (urls.clone(), next.clone());
            move |req| forward(pool.clone(), urls.clone(), next.clone(), req)
        };
        let shutdown = CancellationToken::new();
        let on_signal = shutdown.clone();
        tokio::spawn(async move {
            let _ = tokio::signal::ctrl_c().await;
            on_signal.cancel();
        });
        serve_on_threads(
            listener,
            threads,
            make_handler,
            Limits::default(),
            None,
            Heartbeats::new(threads),
            shutdown,
        )
        .await?;
        Ok(())
    })
}

async fn forward(
    pool: Arc<Pool>,
    urls: Arc<[String]>,
    next: Arc<AtomicUsize>,
    req: Request<Incoming>,
) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) => return answer(StatusCode::BAD_REQUEST, format!("reading the body: {e}")),
    };
    let base = &urls[next.fetch_add(1, Ordering::Relaxed) % urls.len()];
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut request =
        match Request::builder().method(parts.method).uri(format!("{base}{path}")).body(Outgoing::Full(body))
        {
            Ok(request) => request,
            Err(e) => return answer(StatusCode::BAD_REQUEST, e.to_string()),
        };
    *request.headers_mut() = parts.headers;
    // The pool writes `Host` for the replica.
    request.headers_mut().remove(header::HOST);
    match Box::pin(pool.send(request)).await {
        Ok(response) => response.map(BodyExt::boxed_unsync),
        Err(e) => answer(StatusCode::BAD_GATEWAY, e.to_string()),
    }
}

fn answer(status: StatusCode, text: String) -> Response<ProxyBody> {
    let mut response =
        Response::new(Full::new(Bytes::from(text)).map_err(|never| match never {}).boxed_unsync());
    *response.status_mut() = status;
    response
}
