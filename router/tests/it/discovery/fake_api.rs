//! A fake Kubernetes API server serving EndpointSlice list and watch over plain HTTP/1.1 on
//! 127.0.0.1 port 0, enough for kube's client and watcher:
//!
//! - `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=k=v`: a
//!   list with `metadata.resourceVersion`;
//! - the same with `watch=true&resourceVersion=N`: every recorded change after `N`, then live
//!   changes, as chunked JSON lines; `ERROR 410 Gone` if `N` is older than the retained
//!   history ([`FakeApi::expire_history`]);
//! - `GET /api/v1/namespaces/{ns}/pods/{name}`: a pod put with [`State::put_pod`], else 404;
//!   `500` while [`State::pod_failures`] lasts.
//!
//! The test drives it: [`FakeApi::apply`] / [`FakeApi::delete`] record a change (and push it
//! to open watches), [`FakeApi::drop_watches`] ends every open watch cleanly, and
//! [`FakeApi::atomically`] runs several of them under one lock so a reconnecting watcher
//! sees all or none of them. Every connection is `Connection: close`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// A `key=value` label selector (the only kind the watcher sends here).
type Selector = Option<(String, String)>;

const PREFIX: &str = "/apis/discovery.k8s.io/v1/namespaces/";

/// The server's state; change it through [`FakeApi`]'s methods.
#[derive(Default)]
pub struct State {
    rv: u64,
    slices: BTreeMap<String, Value>,
    pods: BTreeMap<String, Value>,
    /// Every change: (resourceVersion, event type, object).
    history: Vec<(u64, &'static str, Value)>,
    /// Watches from a resourceVersion below this get `410 Gone`.
    expired_below: u64,
    watchers: Vec<(Selector, mpsc::Sender<String>)>,
    /// Requests served: lists, the resourceVersion of every watch, pod reads.
    pub lists: usize,
    pub watches: Vec<u64>,
    pub pod_gets: usize,
    /// Pod reads still to answer `500 Internal Server Error`.
    pub pod_failures: usize,
}

impl State {
    /// Creates or replaces a slice (its name is `metadata.name`).
    pub fn apply(&mut self, mut slice: Value) {
        self.rv += 1;
        slice["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        let name = slice["metadata"]["name"].as_str().expect("slice name").to_owned();
        let kind = if self.slices.contains_key(&name) { "MODIFIED" } else { "ADDED" };
        self.slices.insert(name, slice.clone());
        self.record(kind, slice);
    }

    /// Creates or replaces a pod (its name is `metadata.name`).
    pub fn put_pod(&mut self, pod: Value) {
        let name = pod["metadata"]["name"].as_str().expect("pod name").to_owned();
        self.pods.insert(name, pod);
    }

    pub fn delete(&mut self, name: &str) {
        let mut slice = self.slices.remove(name).expect("deleting a known slice");
        self.rv += 1;
        slice["metadata"]["resourceVersion"] = json!(self.rv.to_string());
        self.record("DELETED", slice);
    }

    /// Ends every open watch (the client sees a clean end of the response).
    pub fn drop_watches(&mut self) {
        self.watchers.clear();
    }

    /// Forgets the history: watches resuming from before the current version get 410.
    pub fn expire_history(&mut self) {
        self.expired_below = self.rv;
        self.history.clear();
    }

    fn record(&mut self, kind: &'static str, object: Value) {
        let line = event_line(kind, &object);
        self.watchers
            .retain(|(selector, tx)| !matches(selector, &object) || tx.try_send(line.clone()).is_ok());
        self.history.push((self.rv, kind, object));
    }
}

fn event_line(kind: &str, object: &Value) -> String {
    format!("{}\n", json!({"type": kind, "object": object}))
}

fn matches(selector: &Selector, object: &Value) -> bool {
    selector
        .as_ref()
        .is_none_or(|(k, v)| object["metadata"]["labels"][k.as_str()].as_str() == Some(v.as_str()))
}

/// The running fake API server; stops on drop.
pub struct FakeApi {
    pub addr: SocketAddr,
    state: Arc<Mutex<State>>,
    shutdown: CancellationToken,
}

impl FakeApi {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind fake API server");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(Mutex::new(State::default()));
        let shutdown = CancellationToken::new();
        let (st, stop) = (state.clone(), shutdown.clone());
        tokio::spawn(async move {
            loop {
                let conn = tokio::select! {
                    () = stop.cancelled() => return,
                    conn = listener.accept() => conn,
                };
                let Ok((stream, _)) = conn else { continue };
                tokio::spawn(serve(stream, st.clone(), stop.clone()));
            }
        });
        Self { addr, state, shutdown }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Runs `f` under the state lock (several changes seen together or not at all).
    pub fn atomically<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        f(&mut self.state.lock().unwrap())
    }

    pub fn apply(&self, slice: Value) {
        self.atomically(|s| s.apply(slice));
    }

    pub fn delete(&self, name: &str) {
        self.atomically(|s| s.delete(name));
    }

    pub fn lists(&self) -> usize {
        self.atomically(|s| s.lists)
    }

    pub fn watches(&self) -> Vec<u64> {
        self.atomically(|s| s.watches.clone())
    }

    pub fn pod_gets(&self) -> usize {
        self.atomically(|s| s.pod_gets)
    }
}

impl Drop for FakeApi {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn serve(mut stream: TcpStream, state: Arc<Mutex<State>>, stop: CancellationToken) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match stream.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let head = String::from_utf8_lossy(&head);
    let target = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let params: BTreeMap<String, String> = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), decode(v)))
        .collect();
    let not_found =
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 404, "reason": "NotFound"});
    if let Some((_, name)) =
        path.strip_prefix("/api/v1/namespaces/").and_then(|rest| rest.split_once("/pods/"))
    {
        let pod = {
            let mut s = state.lock().unwrap();
            s.pod_gets += 1;
            if s.pod_failures > 0 {
                s.pod_failures -= 1;
                None
            } else {
                Some(s.pods.get(name).cloned())
            }
        };
        let failed = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500, "reason": "InternalError"});
        let Some(pod) = pod else {
            respond(&mut stream, "500 Internal Server Error", &failed.to_string()).await;
            return;
        };
        match pod {
            Some(pod) => respond(&mut stream, "200 OK", &pod.to_string()).await,
            None => respond(&mut stream, "404 Not Found", &not_found.to_string()).await,
        }
        return;
    }
    let is_slices = path.strip_prefix(PREFIX).is_some_and(|rest| rest.ends_with("/endpointslices"));
    if !is_slices {
        respond(&mut stream, "404 Not Found", &not_found.to_string()).await;
        return;
    }
    let selector =
        params.get("labelSelector").and_then(|s| s.split_once('=')).map(|(k, v)| (k.into(), v.into()));
    if params.get("watch").map(String::as_str) != Some("true") {
        let body = {
            let mut s = state.lock().unwrap();
            s.lists += 1;
            let items: Vec<&Value> = s.slices.values().filter(|o| matches(&selector, o)).collect();
            json!({
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": s.rv.to_string()},
                "items": items,
            })
        };
        respond(&mut stream, "200 OK", &body.to_string()).await;
        return;
    }
    let from: u64 = params.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    let (tx, mut rx) = mpsc::channel(1024);
    let backlog: Vec<String> = {
        let mut s = state.lock().unwrap();
        s.watches.push(from);
        if from < s.expired_below {
            // Like the API server: one ERROR event, then the response ends.
            drop(tx);
            let gone = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "too old resource version", "reason": "Expired", "code": 410});
            vec![event_line("ERROR", &gone)]
        } else {
            let lines = s
                .history
                .iter()
                .filter(|(rv, _, o)| *rv > from && matches(&selector, o))
                .map(|(_, kind, o)| event_line(kind, o))
                .collect();
            s.watchers.push((selector, tx));
            lines
        }
    };
    let headers = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    if stream.write_all(headers.as_bytes()).await.is_err() {
        return;
    }
    for line in backlog {
        if write_chunk(&mut stream, &line).await.is_err() {
            return;
        }
    }
    loop {
        let line = tokio::select! {
            () = stop.cancelled() => return,
            line = rx.recv() => line,
        };
        match line {
            Some(line) if write_chunk(&mut stream, &line).await.is_ok() => {}
            Some(_) => return,
            // Dropped (or a 410 answer, whose sender was never kept): end the response.
            None => break,
        }
    }
    // The client may be gone already; nothing to do about it then.
    let _ = stream.write_all(b"0\r\n\r\n").await;
    let _ = stream.shutdown().await;
}

async fn write_chunk(stream: &mut TcpStream, data: &str) -> std::io::Result<()> {
    stream.write_all(format!("{:x}\r\n{data}\r\n", data.len()).as_bytes()).await?;
    stream.flush().await
}

async fn respond(stream: &mut TcpStream, status: &str, body: &str) {
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// Percent-decoding of a query value.
fn decode(v: &str) -> String {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
