//! WebSocket upgrades (vLLM's `/v1/realtime`, its Responses API at `/v1/responses`),
//! tunnelled to a replica.
//!
//! The handshake (an HTTP/1.1 `GET` whose `Connection` names `upgrade`) goes to the
//! least-loaded eligible replica on a connection of its own, with its `Upgrade` field (a
//! hop-by-hop field, which this hop asks for too). When the replica answers `101`, the client
//! gets that answer and the two connections are spliced byte for byte until both ends have
//! closed (a close is passed on as a half-close), either fails, or no byte moves either way
//! for `--idle-timeout-ms` (as nginx's `proxy_read_timeout` bounds a WebSocket's silence).
//! Any other answer (a replica without realtime answers 404) is passed on as an ordinary
//! response.
//!
//! A session holds its place under `--max-in-flight`, and counts as a request in flight on its
//! replica, for as long as it lasts. It ends when the router shuts down (both connections are
//! closed; its client reconnects, to another router): a session may last for hours, where a
//! stream ends with its generation, and the shutdown would wait for it. (Each holds two sockets
//! outside `--max-connections`, which counts the connections the server reads requests from.)
//! It ends too when its key is revoked (a reload, `--api-key-file` changed): a session is
//! checked again whenever the keys change, as its handshake would be. A replica that refuses
//! the connection or fails before answering is counted against it and the next one is tried, as
//! for other requests; a `101` without an `Upgrade` to `websocket` is a malformed answer. A
//! handshake with a body is refused (400): its bytes would reach the replica as the new
//! protocol's.
//!
//! Only HTTP/1.1 upgrades: the router does not offer HTTP/2's extended `CONNECT` (RFC 8441),
//! so browsers open their WebSockets to it over HTTP/1.1.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::watch;
use tokio::time::Instant;

use super::body::{ProxyBody, full};
use super::connect::Stream;
use super::error::ProxyError;
use super::forward::{self, Admitted, MAX_ATTEMPTS, X_KVROUTE_REPLICA, X_REQUEST_ID};
use super::http1::WireError;
use super::live::Admission;
use super::pool::{Pool, SendError, Upgrade};
use super::upstream::LoadGuard;
use super::{ProxyState, access};
use crate::fleet::Member;

/// A handshake with a body is refused, before it takes a place or room.
pub(super) fn check_handshake(headers: &http::HeaderMap) -> Result<(), ProxyError> {
    match headers.contains_key(header::TRANSFER_ENCODING)
        || headers.get(header::CONTENT_LENGTH).is_some_and(|n| n.as_bytes() != b"0")
    {
        true => Err(ProxyError::Refused("a WebSocket handshake has no body".into())),
        false => Ok(()),
    }
}

/// Sends the handshake `req` (checked: [`check_handshake`]) to the first of `members` (least
/// loaded first) that answers it.
pub(super) async fn open(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    mut req: Request<Incoming>,
    members: Vec<Member>,
    admitted: Admitted<'_>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let (config, metrics) = (&state.forward, &state.decider.metrics);
    let client_side = hyper::upgrade::on(&mut req);
    let background = req.extensions().get::<kvroute_proto::serve::Background>().cloned();
    let (parts, _) = req.into_parts();
    // Subscribed before the keys are looked at again, so that no change falls between.
    let key = Key {
        admission: state.admission.subscribe(),
        path: parts.uri.path().to_owned(),
        authorization: parts.headers.get(header::AUTHORIZATION).cloned(),
    };
    let upgrade: Vec<HeaderValue> = parts.headers.get_all(header::UPGRADE).iter().cloned().collect();
    let (client, mut headers) = forward::upstream_head(parts, admitted.request_id, config);
    asking_for(&mut headers, upgrade);
    let mut last_error = None;
    // A later one gone since the replicas were chosen is passed over, as a retry's is (read
    // when its turn comes).
    let later = members.iter().skip(1).filter(|member| !forward::gone_since(state.fleet(), member, &members));
    for (attempt, member) in members.iter().take(1).chain(later).take(MAX_ATTEMPTS).enumerate() {
        if attempt > 0 {
            metrics.retries.inc();
        }
        let upstream = &member.upstream;
        let guard = upstream.begin(1, 0, 0);
        let uri = forward::replica_uri(&member.replica, &client.uri)?;
        let sent = Instant::now();
        let handshake = pool.upgrade(&client.method, &uri, &headers);
        let name = &member.replica.spec.name;
        match tokio::time::timeout_at(sent + config.control_timeout, handshake).await {
            Ok(Ok(Upgrade::Switched { head, .. })) if !names_websocket(&head.headers) => {
                forward::record_failure(upstream, config, metrics);
                let reason = "101 Switching Protocols without Upgrade: websocket".to_owned();
                return Err(ProxyError::Upstream { replica: name.clone(), reason });
            }
            Ok(Ok(Upgrade::Switched { head, stream, early })) => {
                upstream.record_success();
                let mut response = Response::new(full(Bytes::new()));
                *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
                let mut replica_headers = head.headers;
                let switched_to: Vec<HeaderValue> =
                    replica_headers.get_all(header::UPGRADE).iter().cloned().collect();
                forward::strip_hop_by_hop(&mut replica_headers);
                asking_for(&mut replica_headers, switched_to);
                let headers = response.headers_mut();
                *headers = replica_headers;
                if let Ok(id) = HeaderValue::from_str(admitted.request_id) {
                    headers.insert(X_REQUEST_ID, id);
                }
                if let Ok(v) = HeaderValue::from_str(name) {
                    headers.insert(X_KVROUTE_REPLICA, v);
                }
                let line = config.access_log.then(|| access::Line {
                    replica: name.clone(),
                    status: StatusCode::SWITCHING_PROTOCOLS.as_u16(),
                    attempt,
                    first_data: Some(Instant::now()),
                    ..access::Line::new(&admitted, &client.method, &client.uri)
                });
                let session = Session {
                    guard,
                    _slot: admitted.slot,
                    line,
                    idle: config.idle_timeout,
                    shutdown: state.shutdown.clone(),
                    key,
                };
                let run = session.run(client_side, stream, early);
                match background {
                    Some(background) => drop(background.spawn(run)),
                    None => drop(tokio::spawn(run)),
                }
                return Ok(response);
            }
            Ok(Ok(Upgrade::Answered(response))) => {
                let load = (guard, 0, super::responses::Keeps::Nothing);
                return Ok(forward::passed_on(
                    response,
                    &client,
                    (member, attempt),
                    (sent, sent),
                    load,
                    (config, metrics),
                    admitted,
                ));
            }
            // The replica answered, malformed: it is not tried again elsewhere.
            Ok(Err(e @ SendError::Wire(WireError::Malformed(_)))) => {
                forward::record_failure(upstream, config, metrics);
                return Err(ProxyError::Upstream { replica: name.clone(), reason: e.to_string() });
            }
            Ok(Err(e)) => {
                tracing::warn!(replica = %name, error = %e, request_id = admitted.request_id, "replica failed a WebSocket handshake");
                forward::record_failure(upstream, config, metrics);
                last_error = Some(ProxyError::Upstream { replica: name.clone(), reason: e.to_string() });
            }
            Err(_) => {
                forward::record_failure(upstream, config, metrics);
                return Err(ProxyError::Timeout {
                    replica: name.clone(),
                    timeout_ms: config.control_timeout.as_millis() as u64,
                });
            }
        }
    }
    Err(last_error.unwrap_or_else(|| ProxyError::Unavailable("no healthy replica".into())))
}

/// Puts back the hop-by-hop fields of this hop's switch (taken off with the others):
/// `Connection: upgrade` and `Upgrade: protocols`.
fn asking_for(headers: &mut http::HeaderMap, protocols: Vec<HeaderValue>) {
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    for protocol in protocols {
        headers.append(header::UPGRADE, protocol);
    }
}

/// Whether `headers`' `Upgrade` names `websocket` (a handshake's, or a `101`'s).
pub(super) fn names_websocket(headers: &http::HeaderMap) -> bool {
    headers
        .get_all(header::UPGRADE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .filter_map(|protocol| protocol.trim_ascii().split(|&b| b == b'/').next())
        .any(|name| name.eq_ignore_ascii_case(b"websocket"))
}

/// An open tunnel's hold on the fleet: its replica's load, its in-flight place, its access
/// log line.
struct Session {
    guard: LoadGuard,
    _slot: Option<forward::Slot>,
    line: Option<access::Line>,
    idle: Duration,
    shutdown: tokio_util::sync::CancellationToken,
    key: Key,
}

/// What a tunnel was admitted with, checked again whenever the keys change: a session whose
/// key is revoked (or that carries none, where keys are now required) ends, as a new request
/// with it would be refused.
struct Key {
    admission: watch::Receiver<Arc<Admission>>,
    path: String,
    authorization: Option<HeaderValue>,
}

impl Key {
    /// Returns once the admission in force refuses this key (at once if it does now).
    async fn revoked(&mut self) {
        loop {
            let allowed = self.admission.borrow_and_update().allows(
                &http::Method::GET,
                &self.path,
                self.authorization.as_ref().map(HeaderValue::as_bytes),
            );
            if !allowed {
                return;
            }
            if self.admission.changed().await.is_err() {
                // (The router is going away: its shutdown ends the tunnel.)
                return std::future::pending().await;
            }
        }
    }
}

impl Session {
    /// Waits for the client's connection to be handed over, then splices it with the
    /// replica's, `early` (what the replica sent after its `101`) first.
    async fn run(mut self, client_side: hyper::upgrade::OnUpgrade, replica: Stream, early: BytesMut) {
        let mut client = match client_side.await {
            Ok(upgraded) => TokioIo::new(upgraded),
            Err(e) => {
                // The client went away before its connection was handed over.
                tracing::debug!(error = %e, "a WebSocket client left before its tunnel opened");
                self.finish(super::body::End::Abandoned);
                return;
            }
        };
        let idle = self.idle;
        let spliced = async {
            client.write_all(&early).await?;
            // Out now: over TLS a write may sit in the session's buffer until a flush.
            client.flush().await?;
            splice(&mut client, replica, idle).await
        };
        let end = tokio::select! {
            spliced = spliced => match spliced {
                Ok(()) => super::body::End::Complete,
                // A TLS peer that closed its TCP connection without a `close_notify` (many
                // servers do): closed all the same.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => super::body::End::Complete,
                Err(e) => {
                    tracing::debug!(error = %e, "a WebSocket tunnel ended with an error");
                    super::body::End::Failed
                }
            },
            // Both connections close as the splice is dropped.
            () = self.shutdown.cancelled() => super::body::End::Abandoned,
            () = self.key.revoked() => {
                tracing::info!(path = %self.key.path, "a WebSocket tunnel's key was revoked: the tunnel is closed");
                super::body::End::Abandoned
            }
        };
        self.finish(end);
    }

    fn finish(self, end: super::body::End) {
        if let Some(line) = self.line {
            line.finish(end, None);
        }
        drop(self.guard);
    }
}

/// Copies both ways between `client` and `replica` until both have closed, one fails, or no
/// byte moved either way for `idle` (an error of kind `TimedOut`).
async fn splice<C>(client: &mut C, replica: Stream, idle: Duration) -> std::io::Result<()>
where
    C: AsyncRead + AsyncWrite + Unpin,
{
    let epoch = Instant::now();
    let moved = Arc::new(AtomicU64::new(0));
    let mut client = Watched { inner: client, moved: moved.clone(), epoch };
    let mut replica = Watched { inner: replica, moved: moved.clone(), epoch };
    let copy = tokio::io::copy_bidirectional(&mut client, &mut replica);
    tokio::pin!(copy);
    loop {
        let last = epoch + Duration::from_millis(moved.load(Ordering::Relaxed));
        tokio::select! {
            copied = &mut copy => return copied.map(drop),
            () = tokio::time::sleep_until(last + idle) => {
                if epoch + Duration::from_millis(moved.load(Ordering::Relaxed)) == last {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no data either way for {idle:?}"),
                    ));
                }
            }
        }
    }
}

/// A stream that notes when it last read a byte (milliseconds since `epoch`).
struct Watched<S> {
    inner: S,
    moved: Arc<AtomicU64>,
    epoch: Instant,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            let millis = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
            self.moved.store(millis, Ordering::Relaxed);
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
