//! WebSocket upgrades (vLLM's `/v1/realtime`, its Responses API at `/v1/responses`) through
//! the router: the handshake reaches a replica with its `Upgrade` field, the replica's `101`
//! comes back, and bytes then flow both ways until each end closes.
//!
//! The replica here is a raw socket: the replica agent does not serve the realtime API (it
//! stands in for vLLM's text endpoints), and the router does not read what the tunnel carries.

use std::net::SocketAddr;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;

use crate::proxy::router_in_front_of;

const WAIT: std::time::Duration = std::time::Duration::from_secs(20);

const HANDSHAKE: &str = "GET /v1/realtime?model=m HTTP/1.1\r\nhost: router.example\r\nconnection: Upgrade, x-hop\r\n\
    x-hop: 1\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
    authorization: Bearer k\r\n\r\n";

/// A replica that answers a handshake for `/v1/realtime` with `101`, sends `hello` at once,
/// then echoes what it reads in upper case and, once the client has closed its side, sends
/// `bye` and closes. Any other request gets a 404 (a handshake) or an empty 200 (health
/// checks). Each handshake's head goes to the receiver.
async fn realtime_replica() -> (SocketAddr, mpsc::UnboundedReceiver<String>) {
    realtime_replica_over(None).await
}

/// [`realtime_replica`], over TLS with `tls` if given.
async fn realtime_replica_over(tls: Option<TlsAcceptor>) -> (SocketAddr, mpsc::UnboundedReceiver<String>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (tx, tls) = (tx.clone(), tls.clone());
            tokio::spawn(async move {
                match tls {
                    None => serve_realtime(stream, tx).await,
                    Some(tls) => {
                        if let Ok(stream) = tls.accept(stream).await {
                            serve_realtime(stream, tx).await;
                        }
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// Serves one connection of [`realtime_replica`].
async fn serve_realtime<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, tx: mpsc::UnboundedSender<String>) {
    loop {
        let Some(head) = read_head(&mut stream).await else { return };
        if !head.contains("\r\nupgrade: websocket\r\n") {
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
            continue;
        }
        let realtime = head.starts_with("get /v1/realtime") || head.starts_with("get /v1/responses ");
        let odd = head.starts_with("get /v1/odd-switch");
        let _ = tx.send(head);
        if odd {
            let _ =
                stream.write_all(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\n\r\n").await;
            return;
        }
        if !realtime {
            let refusal = "HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n\
                                       content-length: 22\r\n\r\n{\"detail\":\"Not Found\"}";
            let _ = stream.write_all(refusal.as_bytes()).await;
            continue;
        }
        let switched = "HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n\
                                    sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\nhello";
        if stream.write_all(switched.as_bytes()).await.is_err() {
            return;
        }
        let mut buf = [0u8; 1024];
        while let Ok(n @ 1..) = stream.read(&mut buf).await {
            if stream.write_all(&buf[..n].to_ascii_uppercase()).await.is_err() {
                return;
            }
        }
        let _ = stream.write_all(b"bye").await;
        return;
    }
}

/// Reads a request or response head, lowercased, leaving what follows it unread; `None` at
/// the end of the stream.
async fn read_head<S: AsyncRead + Unpin>(stream: &mut S) -> Option<String> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte).await {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
    }
    Some(String::from_utf8_lossy(&head).to_ascii_lowercase())
}

/// Opens a handshake `head` on the router: the client's stream and the answer's head.
async fn handshake(router: &str, head: &str) -> (TcpStream, String) {
    let mut stream = TcpStream::connect(router.trim_start_matches("http://")).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let answer =
        tokio::time::timeout(WAIT, read_head(&mut stream)).await.expect("in time").expect("an answer");
    (stream, answer)
}

async fn read_exactly(stream: &mut TcpStream, n: usize) -> String {
    let mut buf = vec![0; n];
    tokio::time::timeout(WAIT, stream.read_exact(&mut buf)).await.expect("in time").expect("the bytes");
    String::from_utf8(buf).unwrap()
}

#[tokio::test]
async fn a_websocket_is_tunnelled_to_a_replica_both_ways() {
    let (replica, mut handshakes) = realtime_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let (mut client, answer) = handshake(&router.url(), HANDSHAKE).await;
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    for field in
        ["upgrade: websocket", "connection: upgrade", "sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="]
    {
        assert!(answer.contains(&format!("\r\n{field}\r\n")), "{field}: {answer}");
    }
    assert!(answer.contains("\r\nx-kvroute-replica: r0\r\n"), "{answer}");
    // What the replica sent with its answer comes first.
    assert_eq!(read_exactly(&mut client, 5).await, "hello");
    let seen = handshakes.recv().await.expect("the replica saw the handshake");
    assert!(seen.starts_with("get /v1/realtime?model=m http/1.1\r\n"), "{seen}");
    for field in [
        "upgrade: websocket",
        "connection: upgrade",
        "sec-websocket-key: dghlihnhbxbszsbub25jzq==",
        "authorization: bearer k",
    ] {
        assert!(seen.contains(&format!("\r\n{field}\r\n")), "{field}: {seen}");
    }
    assert!(!seen.contains("x-hop"), "a hop-by-hop field went on: {seen}");
    client.write_all(b"ping").await.unwrap();
    assert_eq!(read_exactly(&mut client, 4).await, "PING");
    client.write_all(b"again").await.unwrap();
    assert_eq!(read_exactly(&mut client, 5).await, "AGAIN");
    // The client's close reaches the replica as the end of its stream; the replica's last
    // bytes and close come back.
    client.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, client.read_to_end(&mut rest)).await.expect("in time").unwrap();
    assert_eq!(rest, b"bye");
    shutdown.cancel();
}

/// vLLM's Responses API over a WebSocket (`GET /v1/responses` with an upgrade) is tunnelled
/// too: it was refused as a method the path does not take (405).
#[tokio::test]
async fn the_responses_websocket_is_tunnelled() {
    let (replica, mut handshakes) = realtime_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let head = HANDSHAKE.replace("/v1/realtime?model=m", "/v1/responses");
    let (mut client, answer) = handshake(&router.url(), &head).await;
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    assert_eq!(read_exactly(&mut client, 5).await, "hello");
    assert!(handshakes.recv().await.unwrap().starts_with("get /v1/responses http/1.1\r\n"));
    client.write_all(b"ping").await.unwrap();
    assert_eq!(read_exactly(&mut client, 4).await, "PING");
    shutdown.cancel();
}

/// A tunnel to an `https://` replica: the handshake and the bytes both ways go over TLS.
#[tokio::test]
async fn a_websocket_is_tunnelled_to_an_https_replica() {
    use tokio_rustls::rustls::{ServerConfig, crypto::ring, pki_types::PrivateKeyDer};
    let dir = crate::support::directory("websocket-tls");
    let authority = crate::support::Authority::new();
    let made = authority.server("127.0.0.1");
    let key = PrivateKeyDer::try_from(made.signing_key.serialize_der()).unwrap();
    let served = ServerConfig::builder_with_provider(std::sync::Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![made.cert.der().clone()], key)
        .unwrap();
    let (replica, mut handshakes) =
        realtime_replica_over(Some(TlsAcceptor::from(std::sync::Arc::new(served)))).await;
    let ca = authority.write(&dir, "ca");
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        replicas: vec![
            format!("name=r0,http=https://{replica},events={},engine=kvroute", crate::support::nowhere())
                .parse()
                .unwrap(),
        ],
        replica_ca_cert: Some(ca),
        ..c
    })
    .await;
    let (mut client, answer) = handshake(&router.url(), HANDSHAKE).await;
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    assert_eq!(read_exactly(&mut client, 5).await, "hello");
    let seen = handshakes.recv().await.expect("the replica saw the handshake");
    assert!(seen.starts_with("get /v1/realtime?model=m http/1.1\r\n"), "{seen}");
    client.write_all(b"ping").await.unwrap();
    assert_eq!(read_exactly(&mut client, 4).await, "PING");
    client.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, client.read_to_end(&mut rest)).await.expect("in time").unwrap();
    assert_eq!(rest, b"bye");
    shutdown.cancel();
    let _ = std::fs::remove_dir_all(dir);
}

/// A replica that does not take the handshake answers as for any request, and that answer
/// comes back as it is.
#[tokio::test]
async fn a_refused_handshake_comes_back_as_the_replica_answered() {
    let (replica, mut handshakes) = realtime_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let head = HANDSHAKE.replace("/v1/realtime?model=m", "/v1/elsewhere");
    let (mut client, answer) = handshake(&router.url(), &head).await;
    assert!(answer.starts_with("http/1.1 404"), "{answer}");
    assert!(answer.contains("\r\nx-kvroute-replica: r0\r\n"), "{answer}");
    assert_eq!(read_exactly(&mut client, 22).await, "{\"detail\":\"Not Found\"}");
    let seen = handshakes.recv().await.expect("the replica saw the handshake");
    assert!(seen.starts_with("get /v1/elsewhere http/1.1\r\n"), "{seen}");
    shutdown.cancel();
}

/// A `101` that does not switch to a WebSocket is a malformed answer (502); a handshake with a
/// body is refused (its bytes would reach the replica as WebSocket data).
#[tokio::test]
async fn a_switch_to_something_else_and_a_handshake_with_a_body_are_refused() {
    let (replica, _handshakes) = realtime_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let (_, answer) =
        handshake(&router.url(), &HANDSHAKE.replace("/v1/realtime?model=m", "/v1/odd-switch")).await;
    assert!(answer.starts_with("http/1.1 502"), "{answer}");
    let with_body = HANDSHAKE.replace("authorization: Bearer k\r\n\r\n", "content-length: 5\r\n\r\nhello");
    let (_, answer) = handshake(&router.url(), &with_body).await;
    assert!(answer.starts_with("http/1.1 400"), "{answer}");
    shutdown.cancel();
}

/// An open tunnel ends when the router shuts down: its client sees the connection close, and
/// the shutdown does not wait for the session.
#[tokio::test]
async fn a_tunnel_ends_with_the_router() {
    let (replica, _handshakes) = realtime_replica().await;
    let (router, _shutdown) = router_in_front_of(replica, |c| c).await;
    let (mut client, answer) = handshake(&router.url(), HANDSHAKE).await;
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    assert_eq!(read_exactly(&mut client, 5).await, "hello");
    tokio::time::timeout(WAIT, router.stop()).await.expect("the router stopped");
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, client.read_to_end(&mut rest)).await.expect("closed").unwrap();
    assert!(rest.is_empty(), "{rest:?}");
}

/// A tunnel in which nothing moves for the idle timeout is closed; while it is open it holds
/// its place under `--max-in-flight`, and gives it back when it closes.
#[tokio::test]
async fn a_silent_tunnel_is_closed_and_holds_an_in_flight_place_till_then() {
    let (replica, _handshakes) = realtime_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        idle_timeout_ms: 1000,
        max_in_flight: 1,
        // A second handshake would wait for the place (`queue`'s tests), not be refused.
        queue_timeout_ms: 0,
        ..c
    })
    .await;
    let (mut client, answer) = handshake(&router.url(), HANDSHAKE).await;
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    let (_, busy) = handshake(&router.url(), HANDSHAKE).await;
    assert!(busy.starts_with("http/1.1 503"), "a second session while the first holds the place: {busy}");
    // The replica's greeting, then silence both ways: the router closes the tunnel.
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, client.read_to_end(&mut rest)).await.expect("closed in time").unwrap();
    assert_eq!(rest, b"hello");
    let reopened = async {
        loop {
            let (_, answer) = handshake(&router.url(), HANDSHAKE).await;
            if answer.starts_with("http/1.1 101") {
                return;
            }
            assert!(answer.starts_with("http/1.1 503"), "{answer}");
            tokio::task::yield_now().await;
        }
    };
    tokio::time::timeout(WAIT, reopened).await.expect("the place is given back");
    shutdown.cancel();
}

/// A replica that refuses the connection is counted against it and the handshake goes on to
/// the next one.
#[tokio::test]
async fn a_handshake_goes_on_past_a_replica_that_refuses_the_connection() {
    let (replica, _handshakes) = realtime_replica().await;
    let closed = kvroute_proto::loopback_port::unused().unwrap();
    let events = kvroute_proto::loopback_port::unused().unwrap();
    let spec = |name: &str, at: String| {
        format!("name={name},http=http://{at},events=tcp://127.0.0.1:{events},topic={name},engine=kvroute")
            .parse()
            .unwrap()
    };
    let config = kvroute_router::Config {
        model: crate::fleet::FLEET_MODEL.into(),
        replicas: vec![spec("gone", format!("127.0.0.1:{closed}")), spec("live", replica.to_string())],
        // Health checks would find the closed port first and leave nothing to retry.
        health_interval_ms: 3_600_000,
        ..kvroute_router::Config::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    // Ties between equally loaded replicas go by the request id: some ids try `gone` first.
    let mut retried = false;
    for i in 0..64 {
        let head = HANDSHAKE.replace("authorization", &format!("x-request-id: ws-{i}\r\nauthorization"));
        let (_, answer) = handshake(&router.url(), &head).await;
        assert!(answer.starts_with("http/1.1 101"), "{answer}");
        assert!(answer.contains("\r\nx-kvroute-replica: live\r\n"), "{answer}");
        let metrics = get_body(&router.url(), "/metrics").await;
        if metrics.lines().any(|l| l.starts_with("kvroute_router_retries_total ") && !l.ends_with(" 0")) {
            retried = true;
            break;
        }
    }
    assert!(retried, "no handshake was tried on the closed replica first");
    shutdown.cancel();
}

/// A handshake whose first replica closes the connection without answering is not retried
/// on a replica drained meanwhile (it was chosen before the drain): the first one's failure
/// is the answer.
#[tokio::test]
async fn a_handshake_passes_over_a_replica_drained_since_it_was_chosen() {
    let (live, _handshakes) = realtime_replica().await;
    // Reads a handshake, tells of it, and closes the connection once `gate` lets it.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let closing = listener.local_addr().unwrap();
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (told, mut arrived) = mpsc::unbounded_channel();
    let let_go = gate.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (gate, told) = (gate.clone(), told.clone());
            tokio::spawn(async move {
                if read_head(&mut stream).await.is_some() {
                    let _ = told.send(());
                    drop(gate.acquire().await);
                }
            });
        }
    });
    let events = kvroute_proto::loopback_port::unused().unwrap();
    let spec = |name: &str, at: SocketAddr| {
        format!("name={name},http=http://{at},events=tcp://127.0.0.1:{events},topic={name},engine=kvroute")
            .parse()
            .unwrap()
    };
    let config = kvroute_router::Config {
        model: crate::fleet::FLEET_MODEL.into(),
        replicas: vec![spec("closing", closing), spec("live", live)],
        health_interval_ms: 3_600_000,
        ..kvroute_router::Config::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    // Ties between equally loaded replicas go by the request id: some ids try `closing` first.
    let held = 'held: {
        for i in 0..64 {
            let head = HANDSHAKE.replace("authorization", &format!("x-request-id: ws-{i}\r\nauthorization"));
            let url = router.url();
            let mut sent = tokio::spawn(async move { handshake(&url, &head).await.1 });
            tokio::select! {
                _ = arrived.recv() => break 'held sent,
                answer = &mut sent => assert!(answer.unwrap().starts_with("http/1.1 101")),
            }
        }
        panic!("no handshake was tried on the closing replica first");
    };
    router.fleet().set_draining("live", true).unwrap();
    let_go.add_permits(1);
    let answer = tokio::time::timeout(WAIT, held).await.expect("in time").unwrap();
    assert!(!answer.contains("x-kvroute-replica: live"), "retried on a drained replica: {answer}");
    assert!(answer.starts_with("http/1.1 502"), "{answer}");
    shutdown.cancel();
}

/// The body of a GET on the router (read to the connection's close).
async fn get_body(router: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(router.trim_start_matches("http://")).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut all = Vec::new();
    tokio::time::timeout(WAIT, stream.read_to_end(&mut all)).await.expect("in time").unwrap();
    String::from_utf8_lossy(&all).into_owned()
}

/// A tunnel whose key is rotated out of `--api-key-file` is closed when the file changes, as a
/// new handshake with that key is refused; one whose key stays goes on.
#[tokio::test]
async fn a_tunnel_whose_key_is_revoked_is_closed() {
    let dir = crate::support::directory("ws-keys");
    let keys = dir.join("keys");
    std::fs::write(&keys, "k\nkept\n").unwrap();
    let (replica, _handshakes) = realtime_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        api_key_file: Some(keys.clone()),
        api_key_check_ms: 20,
        ..c
    })
    .await;
    let (mut revoked, answer) = handshake(&router.url(), HANDSHAKE).await;
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    let (mut kept, answer) =
        handshake(&router.url(), &HANDSHAKE.replace("Bearer k\r\n", "Bearer kept\r\n")).await;
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    for client in [&mut revoked, &mut kept] {
        assert_eq!(read_exactly(client, 5).await, "hello");
        client.write_all(b"ping").await.unwrap();
        assert_eq!(read_exactly(client, 4).await, "PING");
    }

    std::fs::write(&keys, "kept\n").unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, revoked.read_to_end(&mut rest)).await.expect("closed in time").unwrap();
    assert!(rest.is_empty(), "{rest:?}");
    let (_, refused) = handshake(&router.url(), HANDSHAKE).await;
    assert!(refused.starts_with("http/1.1 401"), "{refused}");
    kept.write_all(b"still").await.unwrap();
    assert_eq!(read_exactly(&mut kept, 5).await, "STILL");
    shutdown.cancel();
    let _ = std::fs::remove_dir_all(dir);
}

/// A session holds its key's place under `--max-in-flight-per-key` for as long as it runs (not
/// only its handshake): another handshake with that key is refused until it ends.
#[tokio::test]
async fn a_tunnel_holds_its_keys_place_while_it_runs() {
    let (replica, _handshakes) = realtime_replica().await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        api_key: vec!["k".into()],
        max_in_flight_per_key: 1,
        ..c
    })
    .await;
    let (mut session, answer) = handshake(&router.url(), HANDSHAKE).await;
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    assert_eq!(read_exactly(&mut session, 5).await, "hello");
    let (_, refused) = handshake(&router.url(), HANDSHAKE).await;
    assert!(refused.starts_with("http/1.1 429"), "{refused}");
    // Closed, the session gives its place back.
    session.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(WAIT, session.read_to_end(&mut rest)).await.expect("closed in time").unwrap();
    let url = router.url();
    crate::support::wait_until_async("the key's place is back", async || {
        handshake(&url, HANDSHAKE).await.1.starts_with("http/1.1 101")
    })
    .await;
    shutdown.cancel();
}
