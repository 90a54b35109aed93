//! A relay between a `zeromq` socket and its `tcp://` peers that refuses messages larger
//! than [`MAX_MESSAGE_BYTES`] or [`MAX_MESSAGE_FRAMES`] from the peer side.
//!
//! `zeromq` 0.7 reserves the length a frame header announces before it reads the frame, and
//! keeps every frame of a multipart message until its last; it has no option to bound
//! either: a peer that announces 2^62 bytes aborts the process (the allocation fails), one
//! that never ends a message grows it without limit. So the socket talks to its peers
//! through a relay, which passes bytes both ways and follows the ZMTP framing of what the
//! peer sends ([`frames`]). As soon as a length takes a message over the limits it closes
//! both connections, before the socket has read that length whole; the socket sees a
//! dropped connection, as with any other.
//!
//! - [`ZmtpGuard::connecting`] (the router's SUB and DEALER): the socket connects to a
//!   loopback listener, which dials the real endpoint for each connection. Like `zeromq` on
//!   its own, it retries a refused connection (50 ms, doubling to 30 s, with jitter) for as
//!   long as the socket waits, and passes any other dial failure on at once (it closes the
//!   socket's connection). One difference: `zeromq`'s background reconnect waits in its
//!   handshake while the relay retries, so it learns of the peer's return through the relay.
//! - [`ZmtpGuard::binding`] (the replica agent's PUB and ROUTER): the socket binds a loopback
//!   port, and the guard listens on the public address and relays each peer to it. A peer
//!   there only subscribes or asks, so a subscriber may send 64 KiB over its connection in
//!   all, commands included, each frame charged 32 bytes more (`zeromq`'s PUB keeps every
//!   subscription it is sent; a replay client's requests, which leave no state, are not
//!   counted: it may ask again and again on one connection, as vLLM's clients do); it must finish its handshake (greeting and READY) within 10 s
//!   of connecting (`zeromq`'s own handshake has no deadline); once behind what the socket
//!   sends it, it must take 64 KiB in every 30 s until it catches up, and catch up within
//!   10 min (`zeromq`'s PUB queues without bound for a subscriber that stops reading, reads
//!   a trickle, or reads slower than it sends: cut, the peer reconnects and resyncs); and at most 256 peers are relayed at once. Its refusals are logged at debug level (any client could fill the log
//!   otherwise), the publisher's at warn.
//!
//! Endpoints other than `tcp://` (`ipc://`, `inproc://`) are on this host and are not
//! relayed.

pub mod frames;

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};

pub use frames::{Frames, MAX_MESSAGE_BYTES, MAX_MESSAGE_FRAMES, NULL_GREETING, Refused};

/// Called once for every connection cut for a message over the limits (a metric, say).
pub type OnRefused = Arc<dyn Fn() + Send + Sync>;

/// Most connections relayed at once by a connecting guard: a socket has one, and one more
/// while it reconnects.
const MAX_CONNECTING_PIPES: usize = 8;

/// Most peers relayed at once by a binding guard.
const MAX_BOUND_PIPES: usize = 256;

/// What a peer of a bound socket may send over its connection ([`Frames::with_budget`]) by
/// default: a subscriber sends its handshake and subscriptions, a few hundred bytes (a PUB
/// keeps every subscription it is sent). [`ZmtpGuard::binding_with_budget`] sets another.
pub const BOUND_PEER_BUDGET: u64 = 64 << 10;

/// Time a peer of a bound socket has from connecting to the end of its handshake, so that
/// connections that never finish one cannot hold the guard's places.
const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// A peer of a bound socket that has fallen behind must take [`PEER_MIN_TAKE`] bytes in
/// every `PEER_STALL`, or it is cut.
const PEER_STALL: Duration = Duration::from_secs(30);

/// See [`PEER_STALL`]: 64 KiB in 30 s, far below what a subscriber that reads takes.
const PEER_MIN_TAKE: usize = 64 << 10;

/// Longest a peer of a bound socket may stay behind without catching up once, whatever it
/// takes: one that reads steadily but slower than the socket sends falls further behind for
/// ever, and the socket queues for it without bound (`zeromq` 0.7's PUB has no high-water
/// mark). Cut, it reconnects and resyncs, as after vLLM's PUB drops past its HWM.
const PEER_MAX_BEHIND: Duration = Duration::from_secs(600);

/// A relay for one socket, serving while this lives.
pub struct ZmtpGuard {
    endpoint: String,
    stop: Option<(DropGuard, JoinHandle<()>)>,
}

impl ZmtpGuard {
    /// For a socket that connects to `endpoint`: the loopback endpoint to connect to instead
    /// (`endpoint` itself when it is not `tcp://`).
    pub async fn connecting(endpoint: &str, on_refused: OnRefused) -> io::Result<Self> {
        let Some(target) = endpoint.strip_prefix("tcp://") else {
            return Ok(Self { endpoint: endpoint.to_owned(), stop: None });
        };
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let local = format!("tcp://{}", listener.local_addr()?);
        let relay = Relay { target: target.to_owned(), watch: Side::Dialed, budget: u64::MAX, on_refused };
        Ok(relay.start(listener, local, MAX_CONNECTING_PIPES))
    }

    /// For a socket bound at `internal` (a loopback `tcp://` endpoint): listens on `public`
    /// (`tcp://host:port`, `*` for every interface, port 0 for any) and relays each peer to
    /// `internal`. Its [`Self::endpoint`] is `public` with the port resolved.
    pub async fn binding(public: &str, internal: &str, on_refused: OnRefused) -> io::Result<Self> {
        Self::binding_with_budget(public, internal, BOUND_PEER_BUDGET, on_refused).await
    }

    /// [`Self::binding`], each peer allowed `budget` bytes over its connection in all (a
    /// replay ROUTER's peers send requests, which leave no state in the socket: any number).
    pub async fn binding_with_budget(
        public: &str,
        internal: &str,
        budget: u64,
        on_refused: OnRefused,
    ) -> io::Result<Self> {
        let invalid = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("{what}: {public:?}"));
        let address = public.strip_prefix("tcp://").ok_or_else(|| invalid("not a tcp:// endpoint"))?;
        let (host, port) = address.rsplit_once(':').ok_or_else(|| invalid("no port"))?;
        let host = if host == "*" { "0.0.0.0" } else { host.trim_start_matches('[').trim_end_matches(']') };
        let port: u16 = port.parse().map_err(|_| invalid("bad port"))?;
        let listener = TcpListener::bind((host, port)).await?;
        // An IPv6 address shows in brackets.
        let bound = format!("tcp://{}", listener.local_addr()?);
        let target =
            internal.strip_prefix("tcp://").ok_or_else(|| invalid("internal endpoint not tcp://"))?;
        let relay = Relay { target: target.to_owned(), watch: Side::Accepted, budget, on_refused };
        Ok(relay.start(listener, bound, MAX_BOUND_PIPES))
    }

    /// Where the socket connects (connecting), or where peers connect (binding).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Stops relaying and waits until the listening port is closed (dropping the guard
    /// stops it too, the port closing a moment later).
    pub async fn close(self) {
        if let Some((stop, run)) = self.stop {
            drop(stop);
            run.await.ok();
        }
    }
}

/// A greeting, then a command frame announcing 2^62 bytes: what a guard must cut before
/// its socket reads the length (for tests).
pub fn huge_frame() -> Vec<u8> {
    let mut bytes = NULL_GREETING.to_vec();
    bytes.push(0b110);
    bytes.extend_from_slice(&(1u64 << 62).to_be_bytes());
    bytes
}

/// A hostile peer (for tests): a listener on 127.0.0.1 that answers every connection with
/// [`huge_frame`] and holds it open. Its `tcp://` endpoint.
pub async fn huge_frame_peer() -> io::Result<String> {
    let peer = TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("tcp://{}", peer.local_addr()?);
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = peer.accept().await {
            tokio::spawn(async move {
                conn.write_all(&huge_frame()).await.ok();
                let mut sink = [0u8; 256];
                while conn.read(&mut sink).await.is_ok_and(|n| n > 0) {}
            });
        }
    });
    Ok(endpoint)
}

/// The side of a relayed connection whose stream is followed and bounded.
#[derive(Clone, Copy, Debug)]
enum Side {
    /// The connection the relay dialed (the publisher a socket connects to).
    Dialed,
    /// The connection the relay accepted (a peer of a bound socket).
    Accepted,
}

struct Relay {
    target: String,
    watch: Side,
    /// What the watched side may send in all, when it is the accepted one.
    budget: u64,
    on_refused: OnRefused,
}

impl Relay {
    fn start(self, listener: TcpListener, endpoint: String, max_pipes: usize) -> ZmtpGuard {
        let stop = CancellationToken::new();
        let run = tokio::spawn(self.run(listener, Arc::new(Semaphore::new(max_pipes)), stop.clone()));
        ZmtpGuard { endpoint, stop: Some((stop.drop_guard(), run)) }
    }

    async fn run(self, listener: TcpListener, pipes: Arc<Semaphore>, stop: CancellationToken) {
        let relay = Arc::new(self);
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                // Past the limit, the connection is dropped unserved.
                Ok((accepted, _)) => match pipes.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let (relay, stop) = (relay.clone(), stop.clone());
                        tokio::spawn(async move {
                            stop.run_until_cancelled(relay.pipe(accepted)).await;
                            drop(permit);
                        });
                    }
                    Err(_) => {
                        tracing::warn!(target = %relay.target, "ZMTP guard at its connection limit; connection dropped")
                    }
                },
                Err(e) => {
                    tracing::debug!(error = %e, target = %relay.target, "ZMTP guard cannot accept");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }

    /// Relays one connection until either side closes or the watched side sends a message
    /// over the limits.
    async fn pipe(&self, mut accepted: TcpStream) {
        let handshake_by = tokio::time::Instant::now() + HANDSHAKE_DEADLINE;
        // What the accepted side sends before the target is reached is kept for then, and
        // (when it is the watched side) followed as it comes.
        let mut frames = match self.watch {
            Side::Dialed => Frames::default(),
            Side::Accepted => Frames::with_budget(self.budget),
        };
        let mut early = Vec::new();
        let dial = dial(&self.target);
        tokio::pin!(dial);
        let dialed = loop {
            let before = early.len();
            tokio::select! {
                dialed = &mut dial => match dialed {
                    Ok(dialed) => break dialed,
                    Err(e) => return tracing::info!(error = %e, target = %self.target, "cannot reach the ZMTP peer"),
                },
                read = accepted.read_buf(&mut early) => match read {
                    Ok(n) if n > 0 && early.len() <= EARLY_BYTES => {
                        if matches!(self.watch, Side::Accepted) && self.refused(&mut frames, &early[before..]) {
                            return;
                        }
                    }
                    // The socket gave up (its connect timeout), or sent more than a handshake.
                    _ => return,
                },
            }
        };
        for stream in [&accepted, &dialed] {
            tune(stream);
        }
        let (accepted_read, accepted_write) = accepted.into_split();
        let (dialed_read, mut dialed_write) = dialed.into_split();
        if dialed_write.write_all(&early).await.is_err() {
            return;
        }
        // Either direction ending ends both.
        let _: io::Result<()> = match self.watch {
            Side::Dialed => tokio::select! {
                ended = self.watched(frames, handshake_by, dialed_read, accepted_write) => ended,
                ended = plain(accepted_read, dialed_write) => ended,
            },
            Side::Accepted => tokio::select! {
                ended = self.watched(frames, handshake_by, accepted_read, dialed_write) => ended,
                ended = to_peer(dialed_read, accepted_write, &self.target) => ended,
            },
        };
    }

    /// Follows `bytes` in `frames`: true (counted and logged) if they go over the limits.
    fn refused(&self, frames: &mut Frames, bytes: &[u8]) -> bool {
        let Err(refused) = frames.feed(bytes) else { return false };
        (self.on_refused)();
        match self.watch {
            Side::Dialed => {
                tracing::warn!(target = %self.target, ?refused, "ZMTP peer went over the limits; connection closed")
            }
            Side::Accepted => {
                tracing::debug!(target = %self.target, ?refused, "ZMTP peer went over the limits; connection closed")
            }
        }
        true
    }

    /// Copies `from` to `to` while following its framing in `frames`; stops at a message
    /// over the limits (counted and logged), and at `handshake_by` if the accepted side has
    /// not finished its handshake by then.
    async fn watched(
        &self,
        mut frames: Frames,
        handshake_by: tokio::time::Instant,
        mut from: OwnedReadHalf,
        mut to: OwnedWriteHalf,
    ) -> io::Result<()> {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let read = from.read(&mut buf);
            let n = match self.watch {
                Side::Accepted if !frames.handshaken() => {
                    match tokio::time::timeout_at(handshake_by, read).await {
                        Ok(n) => n?,
                        Err(_) => {
                            tracing::debug!(target = %self.target, "ZMTP peer did not finish its handshake in time");
                            return Ok(());
                        }
                    }
                }
                _ => read.await?,
            };
            if n == 0 || self.refused(&mut frames, &buf[..n]) {
                return Ok(());
            }
            to.write_all(&buf[..n]).await?;
        }
    }
}

/// Copies `from` to `to` as it is.
async fn plain(mut from: OwnedReadHalf, mut to: OwnedWriteHalf) -> io::Result<()> {
    tokio::io::copy(&mut from, &mut to).await.map(drop)
}

/// Copies what a bound socket sends to its peer. A peer that has fallen behind (a write to it
/// has to wait) must take [`PEER_MIN_TAKE`] bytes in every [`PEER_STALL`] until it has caught
/// up (a write goes through at once), and catch up within [`PEER_MAX_BEHIND`], or it is cut:
/// one that takes a trickle, or less than the socket sends, would let the socket queue for it
/// without bound as surely as one that takes nothing.
async fn to_peer(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    target: &str,
) -> io::Result<()> {
    let mut buf = vec![0u8; 64 << 10];
    // Since when the peer has been behind, since when it is counted taking (the start of its
    // last window), and what it has taken in it. It has caught up when the socket has nothing
    // more for it (a write that goes through at once after a wait only took what fit).
    let mut behind: Option<(tokio::time::Instant, tokio::time::Instant, usize)> = None;
    loop {
        let at_once = {
            let mut read = tokio::io::ReadBuf::new(&mut buf);
            match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut from).poll_read(cx, &mut read))).await {
                Poll::Ready(done) => Some(done.map(|()| read.filled().len())),
                Poll::Pending => None,
            }
        };
        let n = match at_once {
            Some(n) => n?,
            None => {
                behind = None;
                from.read(&mut buf).await?
            }
        };
        if n == 0 {
            return Ok(());
        }
        let mut rest = &buf[..n];
        while !rest.is_empty() {
            let at_once =
                std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut to).poll_write(cx, rest))).await;
            let written = match at_once {
                Poll::Ready(written) => written?,
                Poll::Pending => {
                    let now = tokio::time::Instant::now();
                    let (first, since, _) = *behind.get_or_insert((now, now, 0));
                    let deadline = (since + PEER_STALL).min(first + PEER_MAX_BEHIND);
                    match tokio::time::timeout_at(deadline, to.write(rest)).await {
                        Ok(written) => written?,
                        Err(_) if deadline == first + PEER_MAX_BEHIND => {
                            tracing::info!(%target, "ZMTP peer stayed behind for {PEER_MAX_BEHIND:?}; connection closed");
                            return Err(io::ErrorKind::TimedOut.into());
                        }
                        Err(_) => {
                            tracing::info!(%target, "ZMTP peer took under {PEER_MIN_TAKE} bytes in {PEER_STALL:?}; connection closed");
                            return Err(io::ErrorKind::TimedOut.into());
                        }
                    }
                }
            };
            if written == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            rest = &rest[written..];
            if let Some((_, since, taken)) = &mut behind {
                *taken += written;
                if *taken >= PEER_MIN_TAKE {
                    (*since, *taken) = (tokio::time::Instant::now(), 0);
                }
            }
        }
    }
}

/// TCP keepalive on a relayed connection: a peer whose host died or was cut off without a
/// FIN or RST (power lost, a partition) is found in about [`KEEPALIVE_IDLE`] + 3 ×
/// [`KEEPALIVE_INTERVAL`] of silence. A vLLM publisher sends nothing while idle and `zeromq`
/// has no heartbeat, so without it a SUB would wait on a dead peer for ever, its replica's
/// index entries kept and its stream still counted as followed.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);

/// A relayed connection's options: no Nagle delay, and keepalive ([`KEEPALIVE_IDLE`]).
fn tune(stream: &TcpStream) {
    stream.set_nodelay(true).ok();
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(3);
    socket2::SockRef::from(stream).set_tcp_keepalive(&keepalive).ok();
}

/// Most bytes of the accepted side's kept while the target is being reached: a greeting and
/// handshake are far fewer.
const EARLY_BYTES: usize = 64 << 10;

/// Connects to `target`, retrying a refused connection as `zeromq` does (50 ms, doubling to
/// 30 s, with up to 10% jitter); the caller bounds the wait.
///
/// A connection to itself is refused too: dialing a port on this host that nobody listens on
/// (a publisher restarting), the kernel can pick that very port as the connection's own, and
/// TCP's simultaneous open then connects the socket to itself, holding the port the
/// publisher is about to listen on again.
async fn dial(target: &str) -> io::Result<TcpStream> {
    let mut delay = Duration::from_millis(50);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let mut jitter = now.subsec_nanos().into();
    loop {
        match TcpStream::connect(target).await {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
            Ok(stream) if connected_to_itself(&stream) => drop(stream),
            connected => return connected,
        }
        jitter = crate::mix::mix64(jitter);
        tokio::time::sleep(delay + delay.mul_f64((jitter % 1000) as f64 / 10_000.0)).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

/// Whether `stream`'s two ends are the same address (see [`dial`]).
fn connected_to_itself(stream: &TcpStream) -> bool {
    matches!((stream.local_addr(), stream.peer_addr()), (Ok(local), Ok(peer)) if local == peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket connected to itself (TCP's simultaneous open, forced here by dialing the port
    /// it is bound to) is told apart; a connection to a listener is not.
    #[tokio::test]
    async fn a_connection_to_itself_is_told_apart() {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let address = socket.local_addr().unwrap();
        let itself = socket.connect(address).await.unwrap();
        assert!(connected_to_itself(&itself));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let other = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        assert!(!connected_to_itself(&other));
    }

    /// The connection a relay dials to a publisher has TCP keepalive on: Linux lists its
    /// keepalive timer (`tr` 2 in `/proc/net/tcp`) while it is idle; 0 without.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_relays_dialed_connection_keeps_alive() {
        let publisher = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = publisher.local_addr().unwrap().port();
        let guard = ZmtpGuard::connecting(&format!("tcp://127.0.0.1:{port}"), Arc::new(|| {})).await.unwrap();
        let _socket = TcpStream::connect(guard.endpoint().trim_start_matches("tcp://")).await.unwrap();
        let (_peer, _) = publisher.accept().await.unwrap();
        // The dialed side's row: remote address the publisher's port, established (`st` 01:
        // an earlier connection to a port of that number may linger in TIME_WAIT, timer 3);
        // its timer column.
        let timer = || {
            let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
            let remote = format!("0100007F:{port:04X}");
            table.lines().find_map(|row| {
                let cols: Vec<&str> = row.split_whitespace().collect();
                (cols.get(2) == Some(&remote.as_str()) && cols.get(3) == Some(&"01"))
                    .then(|| cols[5].split(':').next().unwrap_or("").to_owned())
            })
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while timer().as_deref() != Some("02") && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(timer().as_deref(), Some("02"), "the keepalive timer is armed");
    }

    #[tokio::test]
    async fn endpoints_that_are_not_tcp_are_not_relayed_and_bad_ones_refused() {
        let guard = ZmtpGuard::connecting("ipc:///tmp/kvroute.sock", Arc::new(|| {})).await.unwrap();
        assert_eq!(guard.endpoint(), "ipc:///tmp/kvroute.sock");
        for public in ["ipc:///tmp/x", "tcp://127.0.0.1", "tcp://127.0.0.1:port"] {
            let bound = ZmtpGuard::binding(public, "tcp://127.0.0.1:1", Arc::new(|| {})).await;
            assert_eq!(bound.err().map(|e| e.kind()), Some(io::ErrorKind::InvalidInput), "{public}");
        }
        let any = ZmtpGuard::binding("tcp://*:0", "tcp://127.0.0.1:1", Arc::new(|| {})).await.unwrap();
        assert!(
            any.endpoint().starts_with("tcp://0.0.0.0:") && !any.endpoint().ends_with(":0"),
            "{}",
            any.endpoint()
        );
    }

    /// Both directions pass through as they are, the peer's greeting included.
    #[tokio::test]
    async fn bytes_pass_both_ways() {
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let internal = format!("tcp://{}", target.local_addr().unwrap());
        let guard = ZmtpGuard::binding("tcp://127.0.0.1:0", &internal, Arc::new(|| {})).await.unwrap();
        let mut peer = TcpStream::connect(guard.endpoint().strip_prefix("tcp://").unwrap()).await.unwrap();
        let mut sent = NULL_GREETING.to_vec();
        sent.extend_from_slice(&[0b1, 3, b'a', b'b', b'c', 0, 0]);
        peer.write_all(&sent).await.unwrap();
        let (mut socket, _) = target.accept().await.unwrap();
        let mut got = vec![0u8; sent.len()];
        socket.read_exact(&mut got).await.unwrap();
        assert_eq!(got, sent);
        socket.write_all(b"reply").await.unwrap();
        let mut reply = [0u8; 5];
        peer.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply, b"reply");
    }

    /// A peer that writes before the guard has reached the socket it guards: those bytes
    /// are followed too (the socket here comes up 200 ms late).
    #[tokio::test]
    async fn what_a_peer_sends_before_the_socket_is_reached_is_followed_too() {
        let port = crate::loopback_port::unused().unwrap();
        let refused = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = refused.clone();
        let on_refused: OnRefused = Arc::new(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        });
        let guard = ZmtpGuard::binding("tcp://127.0.0.1:0", &format!("tcp://127.0.0.1:{port}"), on_refused)
            .await
            .unwrap();
        let mut peer = TcpStream::connect(guard.endpoint().strip_prefix("tcp://").unwrap()).await.unwrap();
        peer.write_all(&huge_frame()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        let socket = TcpListener::bind(("127.0.0.1", port)).await.unwrap();
        // The peer is cut, and the socket gets nothing of what it sent.
        let mut rest = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), peer.read_to_end(&mut rest)).await.unwrap().ok();
        assert_eq!(refused.load(std::sync::atomic::Ordering::Relaxed), 1);
        let accepted = tokio::time::timeout(Duration::from_millis(300), socket.accept()).await;
        assert!(accepted.is_err(), "the guard did not even connect");
    }

    #[tokio::test]
    async fn closing_frees_the_port() {
        let guard =
            ZmtpGuard::binding("tcp://127.0.0.1:0", "tcp://127.0.0.1:1", Arc::new(|| {})).await.unwrap();
        let address = guard.endpoint().strip_prefix("tcp://").unwrap().to_owned();
        guard.close().await;
        TcpListener::bind(&address).await.expect("the port is free again");
    }

    /// A bound guard in front of a listener standing in for the socket, and a peer that has
    /// finished its handshake; returns the peer and the socket's side.
    async fn handshaken_peer() -> (ZmtpGuard, TcpStream, TcpStream) {
        let target = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let internal = format!("tcp://{}", target.local_addr().unwrap());
        let guard = ZmtpGuard::binding("tcp://127.0.0.1:0", &internal, Arc::new(|| {})).await.unwrap();
        let mut peer = TcpStream::connect(guard.endpoint().strip_prefix("tcp://").unwrap()).await.unwrap();
        let mut handshake = NULL_GREETING.to_vec();
        handshake.extend_from_slice(&[0b100, 6]);
        handshake.extend_from_slice(b"\x05READY");
        peer.write_all(&handshake).await.unwrap();
        let (mut socket, _) = target.accept().await.unwrap();
        let mut got = vec![0u8; handshake.len()];
        socket.read_exact(&mut got).await.unwrap();
        (guard, peer, socket)
    }

    /// Writes to `socket` until a write fails (the guard closed it).
    async fn flood(mut socket: TcpStream) {
        let chunk = vec![7u8; 64 << 10];
        while socket.write_all(&chunk).await.is_ok() {}
    }

    /// A peer that stops reading is cut once it has taken nothing for `PEER_STALL`, so the
    /// socket behind stops queueing for it (paused clock: the wait passes at once).
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_stops_reading_is_cut() {
        let (_guard, peer, socket) = handshaken_peer().await;
        tokio::time::timeout(PEER_STALL * 10, flood(socket))
            .await
            .expect("the guard cut the peer that stopped reading");
        drop(peer);
    }

    /// A peer behind the socket's stream, through an in-memory pipe (no kernel buffers, so
    /// the paused clock is exact): one that takes 64 KiB every 20 s is kept, one that takes a
    /// trickle (1 KiB every 20 s) is cut.
    #[tokio::test(start_paused = true)]
    async fn a_peer_behind_must_take_its_minimum_in_every_window() {
        for (every_20s, kept) in [(PEER_MIN_TAKE, true), (1024, false)] {
            let (guard_side, mut peer) = tokio::io::duplex(4096);
            let endless = tokio::io::repeat(7);
            let relay = tokio::spawn(async move { to_peer(endless, guard_side, "test").await });
            let mut taken = vec![0u8; every_20s];
            let mut rounds = 0;
            while rounds < 10 && !relay.is_finished() {
                tokio::time::sleep(PEER_STALL * 2 / 3).await;
                if peer.read_exact(&mut taken).await.is_err() {
                    break;
                }
                rounds += 1;
            }
            assert_eq!(!relay.is_finished(), kept, "taking {every_20s} bytes every 20 s");
            if !kept {
                let ended = relay.await.unwrap();
                assert_eq!(ended.unwrap_err().kind(), io::ErrorKind::TimedOut);
            }
        }
    }

    /// A peer that takes its minimum in every window but never catches up (it reads slower
    /// than the socket sends) is cut once it has been behind for [`PEER_MAX_BEHIND`], however
    /// the relay's writes fall against what the connection holds (here 100 000 bytes, so
    /// that a write goes through at once now and then).
    #[tokio::test(start_paused = true)]
    async fn a_peer_that_never_catches_up_is_cut() {
        let (guard_side, mut peer) = tokio::io::duplex(100_000);
        let endless = tokio::io::repeat(7);
        let started = tokio::time::Instant::now();
        let relay = tokio::spawn(async move { to_peer(endless, guard_side, "test").await });
        let mut taken = vec![0u8; PEER_MIN_TAKE];
        while !relay.is_finished() {
            assert!(started.elapsed() < PEER_MAX_BEHIND * 2, "still relayed");
            tokio::time::sleep(PEER_STALL * 2 / 3).await;
            if peer.read_exact(&mut taken).await.is_err() {
                break;
            }
        }
        assert!(started.elapsed() >= PEER_MAX_BEHIND, "cut after {:?}", started.elapsed());
        assert_eq!(relay.await.unwrap().unwrap_err().kind(), io::ErrorKind::TimedOut);
    }
}
