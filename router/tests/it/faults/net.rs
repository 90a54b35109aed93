//! Network faults between the router and a replica: a lossy ZeroMQ relay for the event
//! stream, and a TCP switch in front of a replica's HTTP port that can turn into a black
//! hole (accepts connections, reads everything, never answers).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use zeromq::prelude::*;
use zeromq::{PubSocket, SubSocket};

use crate::support::{Rng, retry_bind};

/// SUB from a replica's event endpoint, PUB to the router, dropping one message in
/// `drop_one_in` (seeded) while lossy.
pub struct Relay {
    pub endpoint: String,
    pub lossy: Arc<AtomicBool>,
    pub dropped: Arc<AtomicU64>,
    pub forwarded: Arc<AtomicU64>,
    stop: CancellationToken,
}

impl Relay {
    /// Binds the PUB on `bind` (port 0 allowed), connects the SUB to `upstream`.
    pub async fn start(upstream: &str, bind: &str, drop_one_in: u64, seed: u64) -> Relay {
        let mut publisher = PubSocket::new();
        let endpoint = retry_bind(&mut publisher, bind).await;
        let mut subscriber = SubSocket::new();
        subscriber.subscribe("").await.expect("subscribe");
        subscriber.connect(upstream).await.expect("the relay reaches the agent");
        let (lossy, dropped, forwarded) = (Arc::new(AtomicBool::new(true)), Arc::default(), Arc::default());
        let stop = CancellationToken::new();
        let relay = Relay {
            endpoint,
            lossy: lossy.clone(),
            dropped: Arc::clone(&dropped),
            forwarded: Arc::clone(&forwarded),
            stop: stop.clone(),
        };
        tokio::spawn(async move {
            let mut rng = Rng::new(seed);
            loop {
                let msg = tokio::select! {
                    () = stop.cancelled() => break,
                    msg = subscriber.recv() => match msg {
                        Ok(msg) => msg,
                        Err(_) => continue,
                    },
                };
                if drop_one_in > 0 && lossy.load(Ordering::Relaxed) && rng.below(drop_one_in) == 0 {
                    dropped.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if publisher.send(msg).await.is_ok() {
                    forwarded.fetch_add(1, Ordering::Relaxed);
                }
            }
            drop(publisher.close().await);
        });
        relay
    }

    pub fn set_lossy(&self, lossy: bool) {
        self.lossy.store(lossy, Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// A TCP forwarder to `upstream` that can become a black hole: while it is one, bytes from
/// clients (new connections and open ones) are read and discarded, and nothing is answered.
pub struct Switch {
    pub addr: SocketAddr,
    black_hole: Arc<AtomicBool>,
    stop: CancellationToken,
}

impl Switch {
    pub async fn start(upstream: SocketAddr) -> Switch {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the switch");
        let addr = listener.local_addr().expect("local addr");
        let black_hole = Arc::new(AtomicBool::new(false));
        let stop = CancellationToken::new();
        let (hole, cancel) = (black_hole.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let (client, _) = tokio::select! {
                    () = cancel.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(_) => continue,
                    },
                };
                tokio::spawn(connection(client, upstream, hole.clone(), cancel.clone()));
            }
        });
        Switch { addr, black_hole, stop }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_black_hole(&self, on: bool) {
        self.black_hole.store(on, Ordering::Relaxed);
    }

    /// Closes every connection and stops accepting: the replica's end of the network is cut.
    pub fn cut(&self) {
        self.stop.cancel();
    }
}

impl Drop for Switch {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    hole: Arc<AtomicBool>,
    cancel: CancellationToken,
) {
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let inbound = async {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            if hole.load(Ordering::Relaxed) {
                continue; // Read, and never answer.
            }
            if server_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let outbound = async {
        drop(tokio::io::copy(&mut server_read, &mut client_write).await);
    };
    tokio::select! {
        () = cancel.cancelled() => {}
        () = inbound => {}
        () = outbound => {}
    }
}
