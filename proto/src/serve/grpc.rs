//! The gRPC servers' side of serving: the router's admin service and the agent's service,
//! plain or over TLS.

use std::io;
use std::time::Duration;

use futures::Stream;
use tokio::net::TcpListener;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::ACCEPT_BACKOFF;
use super::tls::{self, Tls};

/// How long a gRPC server waits for a PING's acknowledgement, and how long a connection may
/// be silent before it sends one.
const GRPC_KEEPALIVE: Duration = Duration::from_secs(20);

/// How long a peer has to finish its TLS handshake: one that never does is let go.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// TLS handshakes under way at once; a connection accepted past that is closed at once.
const MAX_HANDSHAKES: usize = 64;

/// TLS handshakes under way at once from one address: one peer that opens connections and
/// says nothing takes no more, and others are still served meanwhile.
const PEER_HANDSHAKES: usize = 8;

/// A gRPC server as the router's admin service and the agent's service run: a connection
/// whose peer stops answering HTTP/2 PINGs (a client gone with its network, a half-open
/// connection) is closed within a minute. Without that, a graceful shutdown waited for it
/// until TCP gave up on its retransmissions, about 15 minutes.
pub fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(GRPC_KEEPALIVE))
        .http2_keepalive_timeout(Some(GRPC_KEEPALIVE))
}

/// How long a gRPC server's graceful shutdown may take before its connections are dropped
/// ([`drained_within`]).
pub const GRPC_DRAIN: Duration = Duration::from_secs(30);

/// `serving` (a server's `serve_with_incoming_shutdown` on `shutdown`), given at most
/// `deadline` from `shutdown` to finish, then dropped with its connections. A peer that
/// connected and never sent its HTTP/2 preface held a graceful shutdown for ever: hyper waits
/// for the preface without a timer, and the keep-alive PINGs begin after it.
pub async fn drained_within<E>(
    serving: impl Future<Output = Result<(), E>>,
    shutdown: &tokio_util::sync::CancellationToken,
    deadline: Duration,
) -> Result<(), E> {
    let mut serving = std::pin::pin!(serving);
    tokio::select! {
        served = &mut serving => return served,
        () = shutdown.cancelled() => {}
    }
    match tokio::time::timeout(deadline, serving).await {
        Ok(served) => served,
        Err(_) => {
            tracing::warn!(?deadline, "gRPC connections still open at the end of the drain: dropped");
            Ok(())
        }
    }
}

/// The connections `listener` accepts, for a [`grpc_server`]; with `tls`, those whose TLS
/// handshake succeeded (with the certificate `tls` holds when each is accepted: a certificate
/// renewed in place is served from then on; HTTP/2 the one protocol offered by ALPN, the only
/// one a gRPC server speaks). After a failed accept (out of file descriptors, say) it waits
/// [`ACCEPT_BACKOFF`] before the next, as the HTTP servers' loop does, where tonic's own would
/// try again at once and spin a core meanwhile.
///
/// Each handshake runs in a task of its own, within [`HANDSHAKE_TIMEOUT`], while accepting
/// goes on: a peer that stalls in its handshake holds up no other, and one that fails it is
/// logged and dropped. Past [`MAX_HANDSHAKES`] under way, or [`PEER_HANDSHAKES`] from one
/// address, a new connection is closed at once rather than waited on (without the second,
/// one address's idle connections refused everyone). Accepting stops when the server drops
/// the stream.
pub fn grpc_incoming(
    listener: TcpListener,
    tls: Option<Tls>,
) -> impl Stream<Item = io::Result<tls::Stream>> + Send + 'static {
    use futures::StreamExt;
    match tls {
        None => futures::stream::unfold(listener, |listener| async move {
            let stream = accept(&listener).await;
            Some((Ok(tls::Stream::Plain(stream)), listener))
        })
        .left_stream(),
        Some(tls) => {
            let (done, mut handshaken) = tokio::sync::mpsc::channel(MAX_HANDSHAKES);
            tokio::spawn(handshakes(listener, tls, done));
            futures::stream::poll_fn(move |cx| handshaken.poll_recv(cx)).right_stream()
        }
    }
}

/// The next connection `listener` accepts, backing off after a failed accept.
async fn accept(listener: &TcpListener) -> tokio::net::TcpStream {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => return stream,
            Err(e) => {
                tracing::warn!(error = %e, "gRPC accept failed");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
        }
    }
}

/// Accepts connections on `listener` and sends each on to `done` once its TLS handshake is
/// done ([`grpc_incoming`]), until `done`'s receiver is dropped.
async fn handshakes(
    listener: TcpListener,
    tls: Tls,
    done: tokio::sync::mpsc::Sender<io::Result<tls::Stream>>,
) {
    let under_way = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
    let by_peer = PeerCounts::default();
    loop {
        let stream = tokio::select! {
            () = done.closed() => return,
            stream = accept(&listener) => stream,
        };
        let peer = stream.peer_addr().ok();
        let Some(peer_place) = PeerPlace::take(&by_peer, peer.map(|p| p.ip())) else {
            tracing::debug!(
                ?peer,
                "too many gRPC TLS handshakes under way from one address: connection closed"
            );
            continue;
        };
        let Ok(place) = under_way.clone().try_acquire_owned() else {
            tracing::debug!(?peer, "too many gRPC TLS handshakes under way: connection closed");
            continue;
        };
        let (acceptor, done) = (h2_only(&tls), done.clone());
        tokio::spawn(async move {
            let _place = (place, peer_place);
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                Ok(Ok(stream)) => drop(done.send(Ok(tls::Stream::Tls(Box::new(stream)))).await),
                Ok(Err(e)) => tracing::debug!(error = %e, ?peer, "gRPC TLS handshake failed"),
                Err(_) => tracing::debug!(?peer, "gRPC TLS handshake not done in time"),
            }
        });
    }
}

/// Handshakes under way, by the peer's address.
type PeerCounts = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>>;

/// A handshake's place among those of its peer's address ([`PEER_HANDSHAKES`]), given back
/// when dropped.
struct PeerPlace {
    by_peer: PeerCounts,
    peer: Option<std::net::IpAddr>,
}

impl PeerPlace {
    /// A place for a handshake from `peer`, if it has fewer than [`PEER_HANDSHAKES`] under way.
    fn take(by_peer: &PeerCounts, peer: Option<std::net::IpAddr>) -> Option<Self> {
        if let Some(ip) = peer {
            let mut counts = by_peer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let count = counts.entry(ip).or_default();
            if *count >= PEER_HANDSHAKES {
                return None;
            }
            *count += 1;
        }
        Some(Self { by_peer: by_peer.clone(), peer })
    }
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let Some(ip) = self.peer else { return };
        let mut counts = self.by_peer.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(count) = counts.get_mut(&ip) {
            *count -= 1;
            if *count == 0 {
                counts.remove(&ip);
            }
        }
    }
}

/// `tls`'s acceptor as it is now, offering only HTTP/2 by ALPN: a client that offers HTTP/1.1
/// too (a browser, curl) is told HTTP/2 or nothing, not given a protocol the server lacks.
fn h2_only(tls: &Tls) -> tokio_rustls::TlsAcceptor {
    let acceptor = tls.acceptor();
    let mut config = tokio_rustls::rustls::ServerConfig::clone(acceptor.config());
    config.alpn_protocols = vec![b"h2".to_vec()];
    tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config))
}

/// What a gRPC service may ask of a connection: its peer's address.
impl Connected for tls::Stream {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        match self {
            tls::Stream::Plain(stream) => stream.connect_info(),
            tls::Stream::Tls(stream) => stream.get_ref().0.connect_info(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use futures::StreamExt;
    use tokio_rustls::rustls::pki_types::ServerName;
    use tokio_rustls::rustls::{ClientConfig, RootCertStore, crypto::ring};

    use super::*;
    use crate::serve::TlsFiles;

    /// A peer that connected and sent nothing does not hold a shutdown past its drain: the
    /// server's graceful shutdown waited for its HTTP/2 preface for ever.
    #[tokio::test]
    async fn a_silent_peer_holds_no_shutdown_past_the_drain() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let serving = grpc_server()
            .add_routes(tonic::service::Routes::default())
            .serve_with_incoming_shutdown(grpc_incoming(listener, None), shutdown.clone().cancelled_owned());
        let served = tokio::spawn({
            let shutdown = shutdown.clone();
            async move { drained_within(serving, &shutdown, Duration::from_millis(200)).await }
        });
        let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        // The server has the connection (it holds the shutdown) before the shutdown comes.
        tokio::task::yield_now().await;
        shutdown.cancel();
        let ended = tokio::time::timeout(Duration::from_secs(20), served).await;
        assert!(ended.expect("the server ends after its drain").unwrap().is_ok());
    }

    /// A TLS client trusting `made`'s certificate, offering `alpn`.
    fn trusting(made: &rcgen::CertifiedKey<rcgen::KeyPair>, alpn: &[&[u8]]) -> ClientConfig {
        let mut roots = RootCertStore::empty();
        roots.add(made.cert.der().clone()).unwrap();
        let mut config = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();
        config
    }

    /// One address's connections that never start their handshake take at most
    /// [`PEER_HANDSHAKES`] places: another address's client is still served. (Its
    /// [`MAX_HANDSHAKES`] of them refused everyone for as long as they were renewed.)
    #[tokio::test]
    async fn one_address_cannot_take_every_handshake_place() {
        let (cert, key, made) = super::tls::test_files("grpc-peer");
        let tls = Tls::from_files(&TlsFiles { cert: cert.clone(), key, client_ca: None }).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = std::pin::pin!(grpc_incoming(listener, Some(tls)));
        let mut stalled = Vec::new();
        for _ in 0..MAX_HANDSHAKES {
            stalled.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let connector = tokio_rustls::TlsConnector::from(Arc::new(trusting(&made, &[b"h2"])));
        let client = async {
            // From another loopback address.
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
            let tcp = socket.connect(addr).await.unwrap();
            connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await
        };
        let within = Duration::from_secs(5);
        let (served, client) = tokio::time::timeout(within, futures::future::join(incoming.next(), client))
            .await
            .expect("another address's handshake is done");
        assert!(matches!(served.unwrap().unwrap(), tls::Stream::Tls(_)));
        assert!(client.is_ok());
        let _ = std::fs::remove_dir_all(cert.parent().unwrap());
    }

    /// A peer that opens a connection and never starts its handshake holds up no other: the
    /// next client's handshake is done, and its connection served, meanwhile, with HTTP/2
    /// where the client offered HTTP/1.1 first. A plain client's connection is not, nor is one
    /// whose client speaks HTTP/1.1 alone.
    #[tokio::test]
    async fn a_stalled_handshake_holds_up_no_other() {
        let (cert, key, made) = super::tls::test_files("grpc");
        let tls = Tls::from_files(&TlsFiles { cert: cert.clone(), key, client_ca: None }).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut incoming = std::pin::pin!(grpc_incoming(listener, Some(tls)));
        let _stalled = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::io::AsyncWriteExt::write_all(&mut plain, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();

        let config = trusting(&made, &[b"http/1.1", b"h2"]);
        let http1_only = trusting(&made, &[b"http/1.1"]);
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let client = async {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap()
        };
        let within = Duration::from_secs(5);
        let (served, client) = tokio::time::timeout(within, futures::future::join(incoming.next(), client))
            .await
            .expect("the handshake is done while another stalls");
        let served = served.unwrap().unwrap();
        assert!(matches!(served, tls::Stream::Tls(_)));
        assert_eq!(client.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let http1 = tokio_rustls::TlsConnector::from(Arc::new(http1_only));
        let refused = http1.connect(ServerName::try_from("localhost").unwrap(), tcp).await;
        assert!(refused.is_err(), "HTTP/1.1 alone is not agreed on");
        assert_eq!(served.connect_info().remote_addr(), Some(client.get_ref().0.local_addr().unwrap()));
        let _ = std::fs::remove_dir_all(cert.parent().unwrap());
    }
}
