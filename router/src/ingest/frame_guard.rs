//! A loopback relay in front of every `tcp://` event and replay connection, which refuses
//! frames announced larger than [`MAX_FRAME_BYTES`].
//!
//! `zeromq` 0.7 reserves the length a frame header announces before it reads the frame, and
//! has no option to bound it: a peer that announces 2^62 bytes aborts the router (the
//! allocation fails). So the SUB and DEALER sockets connect to a relay on 127.0.0.1 instead,
//! which dials the real endpoint for each connection and passes bytes both ways. It follows
//! the ZMTP 3 framing of what the publisher sends (the 64-byte greeting, then frames: a flags
//! byte, a 1- or 8-byte length, the body) and closes both connections as soon as a length
//! over the limit is complete, before the socket has seen it whole. The socket then counts a
//! disconnection and reconnects through the relay, as after any dropped connection; the
//! refusal is counted as `kvroute_ingest_malformed{kind="oversized_frame"}`.
//!
//! Endpoints other than `tcp://` (`ipc://`, `inproc://`) are on this host and connect
//! directly.

use std::io;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::{CancellationToken, DropGuard};

/// Largest frame a publisher may send: a vLLM batch of events or one replayed batch is
/// kilobytes to a few megabytes.
pub(crate) const MAX_FRAME_BYTES: u64 = 64 << 20;

/// The endpoint a socket should connect to; a relay serves it while this lives.
pub(crate) struct FrameGuard {
    endpoint: String,
    _stop: Option<DropGuard>,
}

impl FrameGuard {
    /// A relay to `endpoint` if it is `tcp://`, refusing frames over `max_frame` bytes and
    /// counting them in `oversized`. Should no loopback port be free, the socket connects
    /// directly (logged).
    pub(crate) async fn start(endpoint: &str, max_frame: u64, oversized: Counter) -> Self {
        let direct = || Self { endpoint: endpoint.to_owned(), _stop: None };
        let Some(target) = endpoint.strip_prefix("tcp://") else { return direct() };
        let bound = TcpListener::bind("127.0.0.1:0").await.and_then(|l| Ok((l.local_addr()?, l)));
        let (local, listener) = match bound {
            Ok((address, listener)) => (format!("tcp://{address}"), listener),
            Err(e) => {
                tracing::warn!(error = %e, endpoint, "no loopback port for the frame guard; connecting directly");
                return direct();
            }
        };
        let stop = CancellationToken::new();
        let relay = Relay { target: target.to_owned(), max_frame, oversized, stop: stop.clone() };
        tokio::spawn(relay.run(listener));
        Self { endpoint: local, _stop: Some(stop.drop_guard()) }
    }

    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

struct Relay {
    target: String,
    max_frame: u64,
    oversized: Counter,
    stop: CancellationToken,
}

impl Relay {
    async fn run(self, listener: TcpListener) {
        loop {
            let accepted = tokio::select! {
                () = self.stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((local, _)) => {
                    let pipe = pipe(local, self.target.clone(), self.max_frame, self.oversized.clone());
                    let stop = self.stop.clone();
                    tokio::spawn(async move { stop.run_until_cancelled(pipe).await });
                }
                Err(e) => {
                    tracing::debug!(error = %e, target = %self.target, "frame guard cannot accept");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}

/// Relays one connection until either side closes or the publisher announces a frame
/// over `max_frame` bytes.
async fn pipe(mut local: TcpStream, target: String, max_frame: u64, oversized: Counter) {
    // The socket may write its greeting before the publisher is reached; keep it for then.
    let mut early = Vec::new();
    let dial = dial(&target);
    tokio::pin!(dial);
    let remote = loop {
        tokio::select! {
            remote = &mut dial => break remote,
            read = local.read_buf(&mut early) => match read {
                Ok(n) if n > 0 && early.len() <= EARLY_BYTES => {}
                // The socket gave up (its connect timeout), or sent more than a handshake.
                _ => return,
            },
        }
    };
    for stream in [&local, &remote] {
        stream.set_nodelay(true).ok();
    }
    let (mut local_read, mut local_write) = local.into_split();
    let (mut remote_read, mut remote_write) = remote.into_split();
    let outbound = async {
        remote_write.write_all(&early).await?;
        tokio::io::copy(&mut local_read, &mut remote_write).await
    };
    let inbound = async {
        let mut frames = Frames::default();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = remote_read.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            if let Err(announced) = frames.feed(&buf[..n], max_frame) {
                oversized.inc();
                tracing::warn!(%target, announced, max_frame, "publisher announced an oversized frame; connection closed");
                return Ok(());
            }
            local_write.write_all(&buf[..n]).await?;
        }
    };
    let _: io::Result<_> = tokio::select! {
        sent = outbound => sent.map(drop),
        received = inbound => received,
    };
}

/// Most bytes of the socket's kept while the publisher is being reached: its greeting and
/// handshake are far fewer.
const EARLY_BYTES: usize = 64 << 10;

/// Connects to `target`, retrying failures as `zeromq` does for a peer not up yet (50 ms,
/// doubling up to 30 s): the socket's own connect timeout bounds the wait, by closing its
/// side.
async fn dial(target: &str) -> TcpStream {
    let mut delay = Duration::from_millis(50);
    loop {
        match TcpStream::connect(target).await {
            Ok(stream) => return stream,
            Err(e) => tracing::trace!(error = %e, %target, "frame guard cannot reach the publisher yet"),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

/// Where the publisher's byte stream is in ZMTP 3's framing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Frames {
    /// Bytes of the 64-byte greeting still to come.
    Greeting(usize),
    Flags,
    /// A length being read: its width (1 or 8 bytes), bytes read so far and their value.
    Length {
        width: u8,
        read: u8,
        value: u64,
    },
    /// Body bytes still to come.
    Body(u64),
}

impl Default for Frames {
    fn default() -> Self {
        Frames::Greeting(64)
    }
}

impl Frames {
    /// Follows `bytes`; the announced length if a frame's is over `max`.
    fn feed(&mut self, mut bytes: &[u8], max: u64) -> Result<(), u64> {
        while let Some(&first) = bytes.first() {
            let (next, used) = match *self {
                Frames::Greeting(left) => {
                    let used = left.min(bytes.len());
                    (if used == left { Frames::Flags } else { Frames::Greeting(left - used) }, used)
                }
                // Bit 1 of the flags: an 8-byte length.
                Frames::Flags => {
                    (Frames::Length { width: if first & 0b10 != 0 { 8 } else { 1 }, read: 0, value: 0 }, 1)
                }
                Frames::Length { width, read, value } => {
                    let value = value << 8 | u64::from(first);
                    match read + 1 == width {
                        false => (Frames::Length { width, read: read + 1, value }, 1),
                        true if value > max => return Err(value),
                        true if value == 0 => (Frames::Flags, 1),
                        true => (Frames::Body(value), 1),
                    }
                }
                Frames::Body(left) => {
                    let used = left.min(bytes.len() as u64);
                    (if used == left { Frames::Flags } else { Frames::Body(left - used) }, used as usize)
                }
            };
            *self = next;
            bytes = &bytes[used..];
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use zeromq::prelude::*;
    use zeromq::{SocketOptions, SubSocket};

    use super::*;

    /// A ZMTP 3.1 greeting (NULL mechanism), then `frames`.
    fn stream(frames: &[(u8, &[u8])]) -> Vec<u8> {
        let mut bytes = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 1];
        bytes.extend_from_slice(b"NULL");
        bytes.resize(64, 0);
        for &(flags, body) in frames {
            if body.len() > 255 {
                bytes.push(flags | 0b10);
                bytes.extend_from_slice(&(body.len() as u64).to_be_bytes());
            } else {
                bytes.extend_from_slice(&[flags, body.len() as u8]);
            }
            bytes.extend_from_slice(body);
        }
        bytes
    }

    #[test]
    fn frames_are_followed_across_any_split() {
        let long = vec![7u8; 300];
        let bytes = stream(&[(0b100, b"\x05READY"), (0b1, b"topic"), (0, b""), (0, &long)]);
        for cut in 0..bytes.len() {
            let mut frames = Frames::default();
            frames.feed(&bytes[..cut], 300).unwrap();
            frames.feed(&bytes[cut..], 300).unwrap();
            assert_eq!(frames, Frames::Flags, "cut at {cut}");
        }
        // One byte over the limit is refused, wherever the stream is cut.
        for cut in 0..bytes.len() {
            let mut frames = Frames::default();
            let refused = frames.feed(&bytes[..cut], 299).and_then(|()| frames.feed(&bytes[cut..], 299));
            assert_eq!(refused, Err(300), "cut at {cut}");
        }
    }

    #[test]
    fn a_huge_announced_length_is_refused_before_it_is_complete_downstream() {
        let mut bytes = stream(&[]);
        bytes.push(0b110);
        bytes.extend_from_slice(&(1u64 << 62).to_be_bytes());
        let mut frames = Frames::default();
        // Everything but the length's last byte passes...
        assert_eq!(frames.feed(&bytes[..bytes.len() - 1], MAX_FRAME_BYTES), Ok(()));
        // ...and that byte is refused, so the socket never holds the whole length.
        assert_eq!(frames.feed(&bytes[bytes.len() - 1..], MAX_FRAME_BYTES), Err(1 << 62));
    }

    /// Without the guard, `zeromq` would reserve 2^62 bytes here and abort the test process.
    #[tokio::test]
    async fn a_publisher_announcing_a_huge_frame_is_cut_off_and_counted() {
        let evil = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = evil.local_addr().unwrap();
        tokio::spawn(async move {
            let mut bytes = stream(&[]);
            bytes.push(0b110);
            bytes.extend_from_slice(&(1u64 << 62).to_be_bytes());
            loop {
                let (mut conn, _) = evil.accept().await.unwrap();
                conn.write_all(&bytes).await.unwrap();
                // Hold the connection open, as a publisher that sends the rest would.
                tokio::spawn(async move {
                    let mut sink = [0u8; 256];
                    while conn.read(&mut sink).await.is_ok_and(|n| n > 0) {}
                });
            }
        });
        let oversized = Counter::default();
        let guard = FrameGuard::start(&format!("tcp://{address}"), MAX_FRAME_BYTES, oversized.clone()).await;
        let mut options = SocketOptions::default();
        options.connect_timeout(Duration::from_secs(5));
        let mut sub = SubSocket::with_options(options);
        sub.subscribe("").await.unwrap();
        let connected = tokio::time::timeout(Duration::from_secs(10), sub.connect(guard.endpoint())).await;
        assert!(matches!(connected, Ok(Err(_))), "the handshake fails: {connected:?}");
        assert!(oversized.get() >= 1);
    }

    #[tokio::test]
    async fn other_endpoints_connect_directly() {
        let guard = FrameGuard::start("ipc:///tmp/kvroute.sock", MAX_FRAME_BYTES, Counter::default()).await;
        assert_eq!(guard.endpoint(), "ipc:///tmp/kvroute.sock");
    }
}
