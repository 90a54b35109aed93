//! A loopback relay in front of every `tcp://` event and replay connection, which refuses
//! messages larger than [`MAX_MESSAGE_BYTES`] or [`MAX_MESSAGE_FRAMES`].
//!
//! `zeromq` 0.7 reserves the length a frame header announces before it reads the frame, and
//! keeps every frame of a multipart message until its last; it has no option to bound
//! either: a peer that announces 2^62 bytes aborts the router (the allocation fails), one
//! that never ends a message grows it without limit. So the SUB and DEALER sockets connect
//! to a relay on 127.0.0.1 instead, which dials the real endpoint for each connection and
//! passes bytes both ways. It follows the ZMTP 3 framing of what the publisher sends (the
//! 64-byte greeting, then frames: a flags byte, a 1- or 8-byte length, the body) and closes
//! both connections as soon as a length takes a message over the limit, before the socket
//! has read that length whole. The socket then sees a disconnection and reconnects through
//! the relay, as after any dropped connection; the refusal is counted as
//! `kvroute_ingest_malformed{kind="oversized_frame"}`.
//!
//! Like `zeromq` on its own, the relay retries a publisher that refuses the connection (50
//! ms, doubling to 30 s) for as long as the socket waits for it, and passes other dial
//! failures on at once (it closes the socket's connection). One difference: `zeromq`'s
//! background reconnect waits in its handshake while the relay retries, so it learns of the
//! publisher's return only through the relay. Endpoints other than `tcp://` (`ipc://`,
//! `inproc://`) are on this host and connect directly.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::{CancellationToken, DropGuard};

/// Largest message a publisher may send, all its frames together: a vLLM batch of events or
/// one replayed batch is kilobytes to a few megabytes.
const MAX_MESSAGE_BYTES: u64 = 64 << 20;

/// Most frames in one message: a live batch has three, a replay reply a few.
const MAX_MESSAGE_FRAMES: u32 = 1024;

/// Most connections relayed at once: a socket has one, and one more while it reconnects.
const MAX_PIPES: usize = 8;

/// The endpoint a socket should connect to; a relay serves it while this lives.
pub(crate) struct FrameGuard {
    endpoint: String,
    _stop: Option<DropGuard>,
}

impl FrameGuard {
    /// A relay to `endpoint` if it is `tcp://` (else `endpoint` itself), counting the
    /// messages it refuses in `oversized`.
    pub(crate) async fn start(endpoint: &str, oversized: Counter) -> io::Result<Self> {
        let Some(target) = endpoint.strip_prefix("tcp://") else {
            return Ok(Self { endpoint: endpoint.to_owned(), _stop: None });
        };
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let local = format!("tcp://{}", listener.local_addr()?);
        let stop = CancellationToken::new();
        let relay = Relay {
            target: target.to_owned(),
            oversized,
            pipes: Arc::new(Semaphore::new(MAX_PIPES)),
            stop: stop.clone(),
        };
        tokio::spawn(relay.run(listener));
        Ok(Self { endpoint: local, _stop: Some(stop.drop_guard()) })
    }

    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

struct Relay {
    target: String,
    oversized: Counter,
    pipes: Arc<Semaphore>,
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
                // Past `MAX_PIPES`, the connection is dropped: not the socket's.
                Ok((local, _)) => match self.pipes.clone().try_acquire_owned() {
                    Ok(permit) => {
                        let pipe = pipe(local, self.target.clone(), self.oversized.clone());
                        let stop = self.stop.clone();
                        tokio::spawn(async move {
                            stop.run_until_cancelled(pipe).await;
                            drop(permit);
                        });
                    }
                    Err(_) => tracing::debug!(target = %self.target, "frame guard: too many connections"),
                },
                Err(e) => {
                    tracing::debug!(error = %e, target = %self.target, "frame guard cannot accept");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}

/// Relays one connection until either side closes or the publisher sends a message over
/// the limits.
async fn pipe(mut local: TcpStream, target: String, oversized: Counter) {
    // The socket may write its greeting before the publisher is reached; keep it for then.
    let mut early = Vec::new();
    let dial = dial(&target);
    tokio::pin!(dial);
    let remote = loop {
        tokio::select! {
            remote = &mut dial => match remote {
                Ok(remote) => break remote,
                Err(e) => return tracing::info!(error = %e, %target, "cannot reach the event publisher"),
            },
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
            if let Err(refused) = frames.feed(&buf[..n]) {
                oversized.inc();
                tracing::warn!(%target, ?refused, "event publisher sent a message over the limits; connection closed");
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

/// Connects to `target`, retrying a refused connection as `zeromq` does (50 ms, doubling to
/// 30 s, with jitter); the socket's own connect timeout bounds the wait, by closing its side.
async fn dial(target: &str) -> io::Result<TcpStream> {
    let mut delay = Duration::from_millis(50);
    loop {
        match TcpStream::connect(target).await {
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
            connected => return connected,
        }
        tokio::time::sleep(delay.mul_f64(1.0 + rand::random::<f64>() / 10.0)).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}

/// Why the publisher's stream was cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Refused {
    /// A frame's announced length, or a message's bytes with it, over [`MAX_MESSAGE_BYTES`].
    Bytes(u64),
    /// A message's frames over [`MAX_MESSAGE_FRAMES`].
    Frames(u32),
}

/// Where the publisher's byte stream is in ZMTP 3's framing, and how big the message being
/// sent is so far.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Frames {
    at: At,
    /// Bytes and frames of the message so far (its frames before this one).
    message_bytes: u64,
    message_frames: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum At {
    /// Bytes of the 64-byte greeting still to come.
    Greeting(usize),
    Flags,
    /// A length being read: the frame's flags, its width (1 or 8 bytes), bytes read so far
    /// and their value.
    Length {
        flags: u8,
        width: u8,
        read: u8,
        value: u64,
    },
    /// Body bytes still to come, and whether more frames of the message follow.
    Body {
        left: u64,
        more: bool,
    },
}

impl Default for Frames {
    fn default() -> Self {
        Self { at: At::Greeting(64), message_bytes: 0, message_frames: 0 }
    }
}

impl Frames {
    /// Follows `bytes`; why they go over the limits, if they do.
    fn feed(&mut self, mut bytes: &[u8]) -> Result<(), Refused> {
        while let Some(&first) = bytes.first() {
            let (at, used) = match self.at {
                At::Greeting(left) => {
                    let used = left.min(bytes.len());
                    (if used == left { At::Flags } else { At::Greeting(left - used) }, used)
                }
                // Bit 1 of the flags: an 8-byte length.
                At::Flags => (
                    At::Length {
                        flags: first,
                        width: if first & 0b10 != 0 { 8 } else { 1 },
                        read: 0,
                        value: 0,
                    },
                    1,
                ),
                At::Length { flags, width, read, value } => {
                    let value = value << 8 | u64::from(first);
                    if read + 1 < width {
                        (At::Length { flags, width, read: read + 1, value }, 1)
                    } else {
                        (self.frame(flags, value)?, 1)
                    }
                }
                At::Body { left, more } => {
                    let used = left.min(bytes.len() as u64);
                    (
                        if used == left { self.end(more) } else { At::Body { left: left - used, more } },
                        used as usize,
                    )
                }
            };
            self.at = at;
            bytes = &bytes[used..];
        }
        Ok(())
    }

    /// A frame of `len` bytes begins: refused if its message goes over the limits.
    fn frame(&mut self, flags: u8, len: u64) -> Result<At, Refused> {
        // Bit 2: a command (one frame, never part of a message); bit 0: more frames follow.
        let (command, more) = (flags & 0b100 != 0, flags & 0b1 != 0 && flags & 0b100 == 0);
        let bytes = if command { len } else { self.message_bytes.saturating_add(len) };
        if bytes > MAX_MESSAGE_BYTES {
            return Err(Refused::Bytes(bytes));
        }
        if !command {
            self.message_bytes = bytes;
            self.message_frames += 1;
            if self.message_frames > MAX_MESSAGE_FRAMES {
                return Err(Refused::Frames(self.message_frames));
            }
        }
        Ok(if len == 0 { self.end(more) } else { At::Body { left: len, more } })
    }

    /// A frame ended: so did its message, unless more frames follow.
    fn end(&mut self, more: bool) -> At {
        if !more {
            (self.message_bytes, self.message_frames) = (0, 0);
        }
        At::Flags
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use zeromq::prelude::*;
    use zeromq::{SocketOptions, SubSocket};

    use super::*;

    /// A ZMTP 3.1 greeting (NULL mechanism), then `frames` (flags, body).
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

    /// A greeting, then a command frame announcing 2^62 bytes.
    fn huge_frame() -> Vec<u8> {
        let mut bytes = stream(&[]);
        bytes.push(0b110);
        bytes.extend_from_slice(&(1u64 << 62).to_be_bytes());
        bytes
    }

    /// The result of feeding `bytes` cut at `cut`, and then byte by byte.
    fn fed(bytes: &[u8], cut: usize) -> [Result<Frames, Refused>; 2] {
        let mut frames = Frames::default();
        let split = frames.feed(&bytes[..cut]).and_then(|()| frames.feed(&bytes[cut..])).map(|()| frames);
        let mut frames = Frames::default();
        let bytewise = bytes.chunks(1).try_for_each(|b| frames.feed(b)).map(|()| frames);
        [split, bytewise]
    }

    #[test]
    fn frames_are_followed_across_any_split() {
        let long = vec![7u8; 300];
        let bytes = stream(&[(0b100, b"\x05READY"), (0b1, b"topic"), (0b1, b""), (0, &long), (0, b"x")]);
        for cut in 0..bytes.len() {
            for result in fed(&bytes, cut) {
                assert_eq!(
                    result,
                    Ok(Frames { at: At::Flags, message_bytes: 0, message_frames: 0 }),
                    "cut {cut}"
                );
            }
        }
    }

    #[test]
    fn a_huge_announced_length_is_refused_before_it_is_complete_downstream() {
        let bytes = huge_frame();
        let mut frames = Frames::default();
        // Everything but the length's last byte passes...
        assert_eq!(frames.feed(&bytes[..bytes.len() - 1]), Ok(()));
        // ...and that byte is refused, so the socket never holds the whole length.
        assert_eq!(frames.feed(&bytes[bytes.len() - 1..]), Err(Refused::Bytes(1 << 62)));
    }

    #[test]
    fn a_message_is_bounded_in_all_its_frames_and_bytes() {
        // Two frames that each fit but together go past the limit.
        let half = MAX_MESSAGE_BYTES / 2;
        let frame = |flags: u8| {
            let mut frame = vec![flags | 0b10];
            frame.extend_from_slice(&half.to_be_bytes());
            frame.resize(frame.len() + half as usize, 0);
            frame
        };
        let mut parts = stream(&[(0b1, b"topic")]);
        parts.extend(frame(0b1));
        parts.extend(frame(0));
        assert_eq!(Frames::default().feed(&parts), Err(Refused::Bytes(2 * half + 5)));
        // The same frames as messages of their own pass.
        let mut separate = stream(&[(0, b"topic")]);
        separate.extend(frame(0));
        separate.extend(frame(0));
        assert_eq!(Frames::default().feed(&separate), Ok(()));
        // Endless empty frames of one message.
        let empty: Vec<(u8, &[u8])> = vec![(0b1, b""); MAX_MESSAGE_FRAMES as usize + 1];
        assert_eq!(Frames::default().feed(&stream(&empty)), Err(Refused::Frames(MAX_MESSAGE_FRAMES + 1)));
        let ended: Vec<(u8, &[u8])> = vec![(0, b""); MAX_MESSAGE_FRAMES as usize + 1];
        assert_eq!(Frames::default().feed(&stream(&ended)), Ok(()));
    }

    /// A listener that answers every connection with [`huge_frame`] and then holds it open:
    /// its `tcp://` endpoint.
    pub(crate) async fn huge_frame_peer() -> String {
        let peer = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("tcp://{}", peer.local_addr().unwrap());
        tokio::spawn(async move {
            loop {
                let (mut conn, _) = peer.accept().await.unwrap();
                tokio::spawn(async move {
                    conn.write_all(&huge_frame()).await.ok();
                    let mut sink = [0u8; 256];
                    while conn.read(&mut sink).await.is_ok_and(|n| n > 0) {}
                });
            }
        });
        endpoint
    }

    /// Without the guard, `zeromq` would reserve 2^62 bytes here and abort the test process.
    #[tokio::test]
    async fn a_publisher_announcing_a_huge_frame_is_cut_off_and_counted() {
        let oversized = Counter::default();
        let guard = FrameGuard::start(&huge_frame_peer().await, oversized.clone()).await.unwrap();
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
        let guard = FrameGuard::start("ipc:///tmp/kvroute.sock", Counter::default()).await.unwrap();
        assert_eq!(guard.endpoint(), "ipc:///tmp/kvroute.sock");
    }
}
