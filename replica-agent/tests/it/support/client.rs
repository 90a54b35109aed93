//! A small HTTP client for the agent's API (hyper-util's pooled client, keep-alive).

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::HeaderMap;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// One HTTP/1.1 (or, with [`Client::http2`], HTTP/2) client bound to one agent.
#[derive(Clone)]
pub struct Client {
    addr: SocketAddr,
    pool: Pool<HttpConnector, Full<Bytes>>,
}

/// A whole response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON; panics with the body if it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8(self.body.to_vec()).expect("UTF-8 body")
    }
}

impl Client {
    pub fn new(addr: SocketAddr) -> Self {
        Client { addr, pool: Pool::builder(TokioExecutor::new()).build_http() }
    }

    /// A client that speaks HTTP/2 with prior knowledge.
    pub fn http2(addr: SocketAddr) -> Self {
        Client { addr, pool: Pool::builder(TokioExecutor::new()).http2_only(true).build_http() }
    }

    /// Sends a request and returns the response with its body still streaming.
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: impl Into<Bytes>,
        headers: &[(&str, &str)],
    ) -> Response<Incoming> {
        let mut req = Request::builder().method(method).uri(format!("http://{}{path}", self.addr));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req =
            req.header("content-type", "application/json").body(Full::new(body.into())).expect("request");
        self.pool.request(req).await.expect("request sent")
    }

    /// Sends a request and reads the whole response.
    pub async fn request(&self, method: Method, path: &str, body: impl Into<Bytes>) -> Reply {
        collect(self.send(method, path, body, &[]).await).await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.request(Method::GET, path, Bytes::new()).await
    }

    pub async fn post(&self, path: &str, json: &Value) -> Reply {
        self.request(Method::POST, path, serde_json::to_vec(json).expect("JSON")).await
    }

    /// `POST /tokenize` and the token ids, checking the response's shape.
    pub async fn tokenize(&self, json: &Value) -> Vec<u32> {
        let reply = self.post("/tokenize", json).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text());
        let v = reply.json();
        super::shape::assert_keys(&v, &["count", "max_model_len", "tokens"], "tokenize response");
        let tokens: Vec<u32> = serde_json::from_value(v["tokens"].clone()).expect("token ids");
        assert_eq!(v["count"].as_u64(), Some(tokens.len() as u64));
        tokens
    }
}

/// Reads a whole response.
pub async fn collect(response: Response<Incoming>) -> Reply {
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply { status: parts.status, headers: parts.headers, body }
}

/// The `data:` payloads of an SSE body, in order; panics on anything that is not a
/// well-formed `data: ...\n\n` event.
pub fn sse_events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).expect("UTF-8 stream");
    assert!(text.ends_with("\n\n"), "stream must end with a complete event: {text:?}");
    text[..text.len() - 2]
        .split("\n\n")
        .map(|event| {
            let data = event.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {event:?}"));
            assert!(!data.contains('\n'), "one line per event: {event:?}");
            data.to_owned()
        })
        .collect()
}
