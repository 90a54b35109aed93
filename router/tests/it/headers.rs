//! What the replica receives, and what the client gets back, field by field: end-to-end
//! fields go through as sent, hop-by-hop ones (and any a `Connection` field names) stop at
//! the router, on the routed path and on the streamed one. Also what a refusal (503) does:
//! the request goes on to the next replica, and the refusing one is not ejected.

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::mpsc;

use crate::fleet::FLEET_MODEL;
use crate::proxy::router_in_front_of;

/// The answer to every POST: one end-to-end field and one its `Connection` field names.
const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
    connection: keep-alive, x-reply-hop\r\nx-reply-hop: 1\r\nx-replica-field: yes\r\n\
    content-length: 2\r\n\r\n{}";

/// A request as the replica read it: the request line, the fields (names lowercased, in
/// order) and the body.
#[derive(Debug)]
pub(crate) struct Seen {
    pub(crate) line: String,
    fields: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    pub(crate) fn values(&self, name: &str) -> Vec<&str> {
        self.fields.iter().filter(|(n, _)| n == name).map(|(_, v)| v.as_str()).collect()
    }
}

/// A replica that reports every POST it reads (framed by `content-length`) and answers it
/// with `answer`; anything else (health checks) gets an empty 200.
pub(crate) async fn recording_replica(
    answer: &'static [u8],
) -> (std::net::SocketAddr, mpsc::UnboundedReceiver<Seen>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut stream = BufReader::new(stream);
                loop {
                    let mut line = String::new();
                    if stream.read_line(&mut line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let mut fields = Vec::new();
                    loop {
                        let mut field = String::new();
                        if stream.read_line(&mut field).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let Some((name, value)) = field.trim_end().split_once(':') else { break };
                        fields.push((name.to_ascii_lowercase(), value.trim().to_owned()));
                    }
                    let length = fields
                        .iter()
                        .find(|(n, _)| n == "content-length")
                        .map_or(0, |(_, v)| v.parse().unwrap());
                    let mut body = vec![0; length];
                    if stream.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let post = line.starts_with("POST ");
                    let answer: &[u8] =
                        if post { answer } else { b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n" };
                    if post {
                        let _ = tx.send(Seen { line: line.trim_end().to_owned(), fields, body });
                    }
                    if stream.get_mut().write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, rx)
}

/// Sends `head` and `body` on a new connection and reads the answer's head (lowercased).
async fn exchange(router: &str, head: &str, body: &str) -> String {
    tokio::time::timeout(WAIT, exchange_now(router, head, body)).await.expect("an answer")
}

/// How long the test waits for an answer or for the replica to see a request.
const WAIT: std::time::Duration = std::time::Duration::from_secs(20);

async fn exchange_now(router: &str, head: &str, body: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(router.trim_start_matches("http://")).await.unwrap();
    stream.write_all(format!("{head}content-length: {}\r\n\r\n{body}", body.len()).as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed before the answer's head: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&answer).to_ascii_lowercase()
}

#[tokio::test]
async fn end_to_end_fields_reach_the_replica_and_hop_by_hop_ones_do_not() {
    let (replica, mut seen) = recording_replica(ANSWER).await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let completion =
        serde_json::json!({"model": FLEET_MODEL, "prompt": "a few words", "max_tokens": 1}).to_string();
    for (path, body) in
        [("/v1/completions?trace=1", completion.as_str()), ("/v1/embeddings", "{\"input\":\"x\"}")]
    {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: router.example\r\nconnection: keep-alive, X-Secret-Hop\r\n\
             x-secret-hop: 1\r\nkeep-alive: timeout=5\r\nte: trailers\r\nx-custom: kept\r\n\
             x-multi: a\r\nx-multi: b\r\ncookie: a=1\r\ncookie: b=2\r\nproxy-connection: keep-alive\r\n\
             x-data-parallel-rank: 3\r\ncontent-type: application/json\r\naccept-encoding: gzip, br\r\n"
        );
        let answer = exchange(&router.url(), &head, body).await;
        assert!(answer.starts_with("http/1.1 200"), "{answer}");
        let got =
            tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the replica saw it");
        assert_eq!(got.line, format!("POST {path} HTTP/1.1"));
        assert_eq!(got.body, body.as_bytes(), "{path}: the body unchanged");
        assert_eq!(got.values("host"), [replica.to_string().as_str()], "{path}");
        assert_eq!(got.values("x-custom"), ["kept"], "{path}");
        assert_eq!(got.values("x-multi"), ["a", "b"], "{path}");
        assert_eq!(got.values("cookie"), ["a=1; b=2"], "{path}: one line, as HTTP/1.1 has it");
        assert_eq!(got.values("content-type"), ["application/json"], "{path}");
        assert_eq!(got.values("content-length"), [body.len().to_string().as_str()], "{path}");
        for hop in ["connection", "x-secret-hop", "keep-alive", "te", "proxy-connection"] {
            assert!(got.values(hop).is_empty(), "{path}: {hop} reached the replica: {got:?}");
        }
        // A rank is the router's to name: the client's names a rank of no replica it knows.
        assert!(got.values("x-data-parallel-rank").is_empty(), "{path}: {got:?}");
        // The router reads what it forwards (usage, events, its in-band errors): plain.
        assert_eq!(got.values("accept-encoding"), ["identity"], "{path}");
        let id = got.values("x-request-id");
        assert_eq!(id.len(), 1, "{path}: {got:?}");
        assert!(
            answer.contains(&format!("\r\nx-request-id: {}\r\n", id[0].to_ascii_lowercase())),
            "{answer}"
        );
        assert!(answer.contains("\r\nx-replica-field: yes\r\n"), "{answer}");
        assert!(answer.contains("\r\nx-kvroute-replica: r0\r\n"), "{answer}");
        assert!(!answer.contains("x-reply-hop"), "{answer}");
    }
    shutdown.cancel();
}

/// The router's own answers (its errors, `/v1/models`) let a browser page read them as
/// `--allowed-origins` says; a replica's answer carries the replica's CORS fields only.
#[tokio::test]
async fn the_routers_own_answers_carry_its_cors_fields() {
    let (replica, _seen) = recording_replica(ANSWER).await;
    let from = |origin: &str, method: &str, path: &str| {
        format!(
            "{method} {path} HTTP/1.1\r\nhost: r\r\norigin: {origin}\r\ncontent-type: application/json\r\n"
        )
    };
    let completion =
        serde_json::json!({"model": FLEET_MODEL, "prompt": "a few words", "max_tokens": 1}).to_string();
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let url = router.url();
    let models = exchange(&url, &from("https://app.example", "GET", "/v1/models"), "").await;
    assert!(
        models.starts_with("http/1.1 200") && models.contains("\r\naccess-control-allow-origin: *\r\n"),
        "{models}"
    );
    let error = exchange(&url, &from("https://app.example", "POST", "/v1/completions"), "{not json").await;
    assert!(
        error.starts_with("http/1.1 400") && error.contains("\r\naccess-control-allow-origin: *\r\n"),
        "{error}"
    );
    let forwarded =
        exchange(&url, &from("https://app.example", "POST", "/v1/completions"), &completion).await;
    assert!(forwarded.starts_with("http/1.1 200") && !forwarded.contains("access-control"), "{forwarded}");
    let no_origin = exchange(&url, "GET /v1/models HTTP/1.1\r\nhost: r\r\n", "").await;
    assert!(!no_origin.contains("access-control"), "{no_origin}");
    shutdown.cancel();

    let listed = vec!["https://app.example".to_owned()];
    let (router, shutdown) =
        router_in_front_of(replica, |c| kvroute_router::Config { allowed_origins: listed, ..c }).await;
    let url = router.url();
    let allowed = exchange(&url, &from("https://app.example", "GET", "/v1/models"), "").await;
    assert!(allowed.contains("\r\naccess-control-allow-origin: https://app.example\r\n"), "{allowed}");
    let other = exchange(&url, &from("https://other.example", "GET", "/v1/models"), "").await;
    assert!(
        !other.contains("access-control-allow-origin") && other.contains("\r\nvary: origin\r\n"),
        "{other}"
    );
    shutdown.cancel();
}

/// With `--forwarded-for` the replica learns the client: its address is appended to the
/// client's own `X-Forwarded-For`, and `X-Forwarded-Proto` is the router's scheme, whatever
/// the client said. Without it, the client's fields go through as they are.
#[tokio::test]
async fn forwarded_for_tells_the_replica_the_client() {
    let (replica, mut seen) = recording_replica(ANSWER).await;
    let head = |extra: &str| {
        format!("POST /v1/embeddings HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n{extra}")
    };
    for forwarded_for in [true, false] {
        let (router, shutdown) =
            router_in_front_of(replica, |c| kvroute_router::Config { forwarded_for, ..c }).await;
        for (extra, want_for, want_proto) in [
            ("", "127.0.0.1", "http"),
            (
                "x-forwarded-for: 203.0.113.7\r\nx-forwarded-for: 10.1.1.1\r\nx-forwarded-proto: https\r\n",
                "203.0.113.7, 10.1.1.1, 127.0.0.1",
                "http",
            ),
        ] {
            let answer = exchange(&router.url(), &head(extra), "{\"input\":\"x\"}").await;
            assert!(answer.starts_with("http/1.1 200"), "{answer}");
            let got =
                tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the replica saw it");
            let sent: Vec<&str> = got.values("x-forwarded-for");
            if forwarded_for {
                assert_eq!(
                    (sent, got.values("x-forwarded-proto")),
                    (vec![want_for], vec![want_proto]),
                    "{extra:?}"
                );
            } else {
                let clients: Vec<&str> =
                    extra.lines().filter_map(|l| l.strip_prefix("x-forwarded-for: ")).collect();
                assert_eq!(sent, clients, "passed through as sent");
            }
        }
        shutdown.cancel();
    }
}

/// A router config in front of `replica` (no event stream) that admits the client key
/// `sk-client`.
fn keyed_in_front_of(replica: std::net::SocketAddr) -> kvroute_router::Config {
    let events = crate::support::nowhere();
    kvroute_router::Config {
        model: FLEET_MODEL.into(),
        replicas: vec![
            format!("name=r0,http=http://{replica},events={events},engine=kvroute").parse().unwrap(),
        ],
        api_key: vec!["sk-client".into()],
        ..kvroute_router::Config::loopback(Vec::new())
    }
}

/// With `--replica-api-key`, a request to a path the router's keys guard reaches the replica
/// with that key in place of the client's; an engine's own path outside `/v1` keeps the
/// client's, for the engine to check. A reload changes the key at once.
#[tokio::test]
async fn the_replicas_key_goes_only_where_the_router_guards() {
    let (replica, mut seen) = recording_replica(ANSWER).await;
    let config = kvroute_router::Config {
        replica_api_key: Some(kvroute_router::config::Secret::new("sk-replica")),
        lora_updates: true,
        ..keyed_in_front_of(replica)
    };
    let mut reloader = kvroute_router::reload::Reloader::new(&config);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config.clone(), shutdown.clone()).await.unwrap();
    let lora = "{\"lora_name\":\"sql\",\"lora_path\":\"/adapters/sql\"}";
    let mut sent_as = async |path: &str, body: &str| {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\nauthorization: Bearer sk-client\r\n"
        );
        let answer = exchange(&router.url(), &head, body).await;
        assert!(answer.starts_with("http/1.1 200"), "{path}: {answer}");
        let got =
            tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the replica saw it");
        got.values("authorization").concat()
    };
    for (path, body, sent) in [
        ("/v1/embeddings", "{\"input\":\"x\"}", "Bearer sk-replica"),
        // The router's LoRA fan-out, SGLang's spelling outside `/v1` too.
        ("/load_lora_adapter", lora, "Bearer sk-replica"),
        ("/tokenize", "{\"prompt\":\"x\"}", "Bearer sk-client"),
    ] {
        assert_eq!(sent_as(path, body).await, sent, "{path}");
    }
    let rotated = kvroute_router::Config {
        replica_api_key: Some(kvroute_router::config::Secret::new("sk-rotated")),
        ..config
    };
    assert_eq!(reloader.apply(&router.state, &rotated).await.applied, ["replica-api-key"]);
    assert_eq!(sent_as("/v1/embeddings", "{\"input\":\"x\"}").await, "Bearer sk-rotated");
    shutdown.cancel();
}

/// With `--replica-api-key-file`, the replicas' key is the file's: one written in its place is
/// sent from the next check on, one that does not hold one key leaves the key in use. A reload
/// to `--replica-api-key` sends that one; a reload to a file that cannot be read keeps it; one
/// that names neither sends none (the client's `Authorization` goes on).
#[tokio::test]
async fn the_replicas_key_file_rotates_in_place() {
    let dir = crate::support::directory("replica-key-file");
    let file = dir.join("replica-key");
    // Written whole, by a rename into place (as the kubelet writes a Secret's volume).
    let write = |contents: &str| {
        let next = dir.join("next");
        std::fs::write(&next, contents).unwrap();
        std::fs::rename(&next, &file).unwrap();
    };
    write("sk-file-1\n");
    let (replica, mut seen) = recording_replica(ANSWER).await;
    let config = kvroute_router::Config {
        replica_api_key_file: Some(file.clone()),
        api_key_check_ms: 20,
        ..keyed_in_front_of(replica)
    };
    let mut reloader = kvroute_router::reload::Reloader::new(&config);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config.clone(), shutdown.clone()).await.unwrap();
    let mut sent_as = async || {
        let head = "POST /v1/embeddings HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\nauthorization: Bearer sk-client\r\n";
        let answer = exchange(&router.url(), head, "{\"input\":\"x\"}").await;
        assert!(answer.starts_with("http/1.1 200"), "{answer}");
        let got =
            tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the replica saw it");
        got.values("authorization").concat()
    };
    assert_eq!(sent_as().await, "Bearer sk-file-1");
    write("# rotated\nsk-file-2\n");
    let deadline = tokio::time::Instant::now() + WAIT;
    while sent_as().await != "Bearer sk-file-2" {
        assert!(tokio::time::Instant::now() < deadline, "the rotated key is never sent");
    }
    write("sk-a sk-b");
    let metrics = format!("{}/metrics", router.url());
    let refused = "kvroute_router_replica_api_key_file_loads_total{outcome=\"refused\"}";
    crate::support::wait_until_async("the two keys are refused", async || {
        let scraped = crate::fleet::Http::new().get(&metrics).await.body;
        crate::support::sample(&String::from_utf8_lossy(&scraped), refused) == Some(1)
    })
    .await;
    assert_eq!(sent_as().await, "Bearer sk-file-2", "the key in use stays");

    let flag = kvroute_router::Config {
        replica_api_key: Some(kvroute_router::config::Secret::new("sk-flag")),
        replica_api_key_file: None,
        ..config
    };
    let reloaded = reloader.apply(&router.state, &flag).await;
    assert_eq!(reloaded.applied, ["replica-api-key", "replica-api-key-file"]);
    assert_eq!(sent_as().await, "Bearer sk-flag");
    let missing = kvroute_router::Config {
        replica_api_key: None,
        replica_api_key_file: Some(dir.join("missing")),
        ..flag.clone()
    };
    let reloaded = reloader.apply(&router.state, &missing).await;
    assert!(matches!(reloaded.replica_api_key_file, Some(Err(_))), "{reloaded:?}");
    assert_eq!(sent_as().await, "Bearer sk-flag", "the key in use stays");
    let neither = kvroute_router::Config { replica_api_key: None, ..flag };
    reloader.apply(&router.state, &neither).await;
    assert_eq!(sent_as().await, "Bearer sk-client", "no replicas' key: the client's goes on");
    shutdown.cancel();
    let _ = std::fs::remove_dir_all(dir);
}

/// Upgrades other than a WebSocket's (those are tunnelled: `websocket.rs`): an `h2c` upgrade
/// (curl's `--http2` over plain HTTP) is optional for a server, so the request is served over
/// HTTP/1.1, and so is a request whose `Connection` does not name `upgrade`.
#[tokio::test]
async fn an_upgrade_other_than_a_websockets_is_ignored() {
    let (replica, mut seen) = recording_replica(ANSWER).await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    // Without `Connection: upgrade` the field asks nothing (RFC 9110 §7.8): served.
    let head =
        "POST /v1/embeddings HTTP/1.1\r\nhost: r\r\nupgrade: websocket\r\ncontent-type: application/json\r\n";
    let answer = exchange(&router.url(), head, "{\"input\":\"x\"}").await;
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    let got = tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the replica saw it");
    assert_eq!(got.line, "POST /v1/embeddings HTTP/1.1");
    let head = "POST /v1/embeddings HTTP/1.1\r\nhost: r\r\nconnection: Upgrade, HTTP2-Settings\r\n\
                upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\ncontent-type: application/json\r\n";
    let answer = exchange(&router.url(), head, "{\"input\":\"x\"}").await;
    assert!(answer.starts_with("http/1.1 200"), "{answer}");
    let got = tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the replica saw it");
    assert_eq!(got.line, "POST /v1/embeddings HTTP/1.1");
    assert!(got.values("upgrade").is_empty(), "{got:?}");
    shutdown.cancel();
}

/// A round-robin router in front of the replicas `refusing` and `answering` (so named), as
/// `tweak` makes it.
async fn refusing_then_answering(
    refusing: std::net::SocketAddr,
    answering: std::net::SocketAddr,
    tweak: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config,
) -> (kvroute_router::RunningRouter, tokio_util::sync::CancellationToken) {
    let replica = |name: &str, at: std::net::SocketAddr| {
        format!("name={name},http=http://{at},events={},engine=kvroute", crate::support::nowhere())
            .parse()
            .unwrap()
    };
    let config = tweak(kvroute_router::Config {
        model: FLEET_MODEL.into(),
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        replicas: vec![replica("refusing", refusing), replica("answering", answering)],
        ..kvroute_router::Config::loopback(Vec::new())
    });
    let shutdown = tokio_util::sync::CancellationToken::new();
    (kvroute_router::start(config, shutdown.clone()).await.unwrap(), shutdown)
}

/// A request a replica refuses with 503 is tried on another with the same fields (only
/// `host` differs) and the same body.
#[tokio::test]
async fn a_retried_request_carries_the_same_fields_to_the_next_replica() {
    let (refusing, mut refused) =
        recording_replica(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
    let (answering, mut answered) = recording_replica(ANSWER).await;
    let (router, shutdown) = refusing_then_answering(refusing, answering, |c| c).await;
    let body = serde_json::json!({"model": FLEET_MODEL, "prompt": "retry me", "max_tokens": 1}).to_string();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: router.example\r\nconnection: x-hop\r\nx-hop: 1\r\n\
                x-custom: kept\r\ncontent-type: application/json\r\n";
    // Round-robin: one of two requests goes to the refusing replica first.
    for _ in 0..2 {
        let answer = exchange(&router.url(), head, &body).await;
        assert!(answer.starts_with("http/1.1 200"), "{answer}");
        assert!(answer.contains("\r\nx-kvroute-replica: answering\r\n"), "{answer}");
    }
    let first =
        tokio::time::timeout(WAIT, refused.recv()).await.expect("in time").expect("a refused request");
    let mut second = tokio::time::timeout(WAIT, answered.recv()).await.expect("in time").expect("an answer");
    if second.values("x-request-id") != first.values("x-request-id") {
        second = tokio::time::timeout(WAIT, answered.recv()).await.expect("in time").expect("the retry");
    }
    assert_eq!(
        second.values("x-request-id"),
        first.values("x-request-id"),
        "the retry of the refused request"
    );
    assert_eq!((&second.line, &second.body), (&first.line, &first.body));
    let without_host =
        |seen: &Seen| seen.fields.iter().filter(|(n, _)| n != "host").cloned().collect::<Vec<_>>();
    assert_eq!(without_host(&second), without_host(&first));
    assert_eq!(first.values("host"), [refusing.to_string().as_str()]);
    assert_eq!(second.values("host"), [answering.to_string().as_str()]);
    assert_eq!(first.values("x-custom"), ["kept"]);
    assert!(first.values("x-hop").is_empty() && first.values("connection").is_empty(), "{first:?}");
    shutdown.cancel();
}

/// A retry goes only to a replica that can still take it: one drained while the request was
/// on its first replica is passed over (it was chosen before the drain).
#[tokio::test]
async fn a_retry_passes_over_a_replica_drained_since_the_decision() {
    let answer = retried_after(
        |c| c,
        |router| {
            router.fleet().set_draining("answering", true).unwrap();
        },
    )
    .await;
    assert!(!answer.contains("x-kvroute-replica: answering"), "retried on a drained replica: {answer}");
    // Nowhere left to go: the replica's own refusal is the answer.
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("x-kvroute-replica: refusing"), "{answer}");
}

/// Nor one ejected meanwhile (its other requests failed) while another replica is up.
#[tokio::test]
async fn a_retry_passes_over_a_replica_ejected_since_the_decision() {
    let answer = retried_after(
        |c| c,
        |router| {
            let upstream = router.fleet().member("answering").unwrap().upstream;
            assert!(upstream.record_failure(1, std::time::Duration::from_secs(600)), "ejected");
        },
    )
    .await;
    assert!(!answer.contains("x-kvroute-replica: answering"), "retried on an ejected replica: {answer}");
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("x-kvroute-replica: refusing"), "{answer}");
}

/// Nor one that reached `--max-in-flight-per-replica` meanwhile: when every replica refuses
/// at once (an overloaded fleet), the retries would go on past the limit. (With no line, the
/// refusal is the answer; with one, the retry waits for the replica's room: `queue.rs`.)
#[tokio::test]
async fn a_retry_passes_over_a_replica_saturated_since_the_decision() {
    let mut running = None;
    let answer = retried_after(
        |c| kvroute_router::Config { max_in_flight_per_replica: 1, max_queued: 0, ..c },
        |router| {
            // A request in flight on `answering`: at its limit of one.
            let upstream = router.fleet().member("answering").unwrap().upstream;
            running = Some(upstream.begin(1, 0, 0));
        },
    )
    .await;
    assert!(!answer.contains("x-kvroute-replica: answering"), "retried on a saturated replica: {answer}");
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("x-kvroute-replica: refusing"), "the replica's refusal: {answer}");
    drop(running);
}

/// A request held on the refusing replica (which answers its POSTs 503 once let go), `meanwhile`
/// done to the router while it is held: the answer the client gets.
async fn retried_after(
    tweak: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config,
    meanwhile: impl FnOnce(&kvroute_router::RunningRouter),
) -> String {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (told, mut arrived) = mpsc::unbounded_channel();
    let refused = b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n";
    let refusing = gated_replica(b"POST ", refused, Some(gate.clone()), told).await;
    let (answering, _answered) = recording_replica(ANSWER).await;
    let (router, shutdown) = refusing_then_answering(refusing, answering, tweak).await;
    let body = serde_json::json!({"model": FLEET_MODEL, "prompt": "held", "max_tokens": 1}).to_string();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n";
    // Round-robin: one of the first two requests goes to the refusing replica first.
    let held = loop {
        let (url, body) = (router.url(), body.clone());
        let mut sent = tokio::spawn(async move { exchange(&url, head, &body).await });
        tokio::select! {
            _ = arrived.recv() => break sent,
            answer = &mut sent => assert!(answer.unwrap().starts_with("http/1.1 200")),
        }
    };
    meanwhile(&router);
    gate.add_permits(1);
    let answer = tokio::time::timeout(WAIT, held).await.expect("in time").unwrap();
    shutdown.cancel();
    answer
}

/// A replica on loopback that answers the requests that start with `matching` with `answer`
/// (once `gate` lets it, when given one) and anything else with an empty 200; it tells
/// `asked` of each such request.
async fn gated_replica(
    matching: &'static [u8],
    answer: &'static [u8],
    gate: Option<std::sync::Arc<tokio::sync::Semaphore>>,
    asked: mpsc::UnboundedSender<()>,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let (gate, asked) = (gate.clone(), asked.clone());
            tokio::spawn(async move {
                let mut request = vec![0u8; 8192];
                while let Ok(n @ 1..) = stream.read(&mut request).await {
                    let reply: &[u8] = if request[..n].starts_with(matching) {
                        let _ = asked.send(());
                        if let Some(gate) = &gate {
                            drop(gate.acquire().await);
                        }
                        answer
                    } else {
                        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
                    };
                    if stream.write_all(reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Two lookups of one response id the router does not know, the second made while the first
/// asks the replicas: "answering" has it but answers only once `gate` lets it, "refusing"
/// answers 404 at once. `release` is done once the second lookup waits for the first; then
/// the two replies, and how many times each replica was asked.
async fn two_lookups(
    tweak: impl FnOnce(kvroute_router::Config) -> kvroute_router::Config,
    release: impl FnOnce(&tokio::sync::Semaphore),
) -> (Vec<crate::fleet::Reply>, usize, usize) {
    let gate = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let (has, mut asked_has) = mpsc::unbounded_channel();
    let (lacks, mut asked_lacks) = mpsc::unbounded_channel();
    let found = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let missing = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
    let having = gated_replica(b"GET /v1/responses/", found, Some(gate.clone()), has).await;
    let lacking = gated_replica(b"GET /v1/responses/", missing, None, lacks).await;
    let (router, shutdown) = refusing_then_answering(lacking, having, tweak).await;
    let url = format!("{}/v1/responses/resp_unknown", router.url());
    let get = |url: String| tokio::spawn(async move { crate::fleet::Http::new().get(&url).await });
    let first = get(url.clone());
    tokio::time::timeout(WAIT, asked_has.recv()).await.expect("in time").expect("the first lookup");
    let second = get(url);
    let waited = async || {
        let metrics = crate::fleet::Http::new().get(&format!("{}/metrics", router.url())).await;
        String::from_utf8_lossy(&metrics.body)
            .contains("kvroute_router_response_lookups_total{outcome=\"waited\"} 1")
    };
    crate::support::wait_until_async("the second lookup waits for the first", waited).await;
    release(&gate);
    let mut replies = Vec::new();
    for reply in [first, second] {
        replies.push(tokio::time::timeout(WAIT, reply).await.expect("in time").unwrap());
    }
    shutdown.cancel();
    let count =
        |asked: &mut mpsc::UnboundedReceiver<()>| std::iter::from_fn(|| asked.try_recv().ok()).count();
    (replies, 1 + count(&mut asked_has), count(&mut asked_lacks))
}

/// Two requests about a stored response the router does not know: the second waits for the
/// first one's asking of the replicas and reads its answer, rather than asking every replica
/// again (each router in front of a fleet knows only the responses it served).
#[tokio::test]
async fn lookups_of_one_unknown_response_ask_the_replicas_once() {
    let (replies, asked_has, asked_lacks) = two_lookups(|c| c, |gate| gate.add_permits(16)).await;
    for reply in replies {
        assert_eq!(reply.status, 200, "{}", String::from_utf8_lossy(&reply.body));
        assert_eq!(reply.header("x-kvroute-replica"), Some("answering"));
    }
    // The owner is asked once, then sent both requests.
    assert_eq!((asked_has, asked_lacks), (3, 1));
}

/// When the lookup under way ends without an answer (a replica that may have the response
/// did not answer in time), the lookup that waited for it gets the same 503 at once, rather
/// than asking every replica again for as long.
#[tokio::test]
async fn a_lookup_that_waited_for_an_unanswered_one_is_not_made_again() {
    let quick = |c| kvroute_router::Config { control_timeout_ms: 1_000, ..c };
    let (replies, asked_has, asked_lacks) = two_lookups(quick, |_| {}).await;
    for reply in replies {
        assert_eq!(reply.status, 503, "{}", String::from_utf8_lossy(&reply.body));
    }
    assert_eq!((asked_has, asked_lacks), (1, 1));
}

/// A replica that refuses with 503 (overloaded) is not an outlier: its refusals go to the
/// next replica and never eject it.
#[tokio::test]
async fn refusals_do_not_eject_a_replica() {
    let (refusing, _refused) =
        recording_replica(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n").await;
    let (answering, _answered) = recording_replica(ANSWER).await;
    let (router, shutdown) =
        refusing_then_answering(refusing, answering, |c| kvroute_router::Config { eject_after: 2, ..c })
            .await;
    let body = serde_json::json!({"model": FLEET_MODEL, "prompt": "busy", "max_tokens": 1}).to_string();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n";
    for _ in 0..8 {
        let answer = exchange(&router.url(), head, &body).await;
        assert!(answer.contains("\r\nx-kvroute-replica: answering\r\n"), "{answer}");
    }
    let upstream = router.fleet().member("refusing").unwrap().upstream;
    assert_eq!(
        upstream.requests.load(std::sync::atomic::Ordering::Relaxed),
        4,
        "round-robin tried it 4 times"
    );
    assert_eq!(upstream.eligibility(u32::MAX), Ok(()));
    assert_eq!(upstream.ejections.load(std::sync::atomic::Ordering::Relaxed), 0);
    shutdown.cancel();
}

/// A slow upload to another `/v1/*` path outlasts `--first-byte-timeout-ms`: the replica's
/// clock does not run while the upload waits for the client, so the answer comes back and
/// the replica is not blamed.
#[tokio::test]
async fn a_slow_upload_is_not_the_replicas_first_byte_timeout() {
    let (replica, mut seen) = recording_replica(ANSWER).await;
    let (router, shutdown) = router_in_front_of(replica, |c| kvroute_router::Config {
        first_byte_timeout_ms: 300,
        connect_timeout_ms: 100,
        ..c
    })
    .await;
    let mut stream =
        tokio::net::TcpStream::connect(router.url().trim_start_matches("http://")).await.unwrap();
    let parts = ["{\"input\":", "\"slow ", "but ", "steady ", "upload", "\"}"];
    let length: usize = parts.iter().map(|p| p.len()).sum();
    let head = format!("POST /v1/embeddings HTTP/1.1\r\nhost: r\r\ncontent-length: {length}\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    for (i, part) in parts.iter().enumerate() {
        // One pause twice the first-byte timeout: the client's, not the replica's.
        let pause = if i == 3 { 600 } else { 150 };
        tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
        stream.write_all(part.as_bytes()).await.unwrap();
    }
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(WAIT, stream.read(&mut answer)).await.expect("an answer").unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 200"), "1.35 s of upload, a 300 ms first-byte timeout: {answer}");
    let got = tokio::time::timeout(WAIT, seen.recv()).await.expect("in time").expect("the replica saw it");
    assert_eq!(got.body, parts.concat().as_bytes());
    shutdown.cancel();
}

/// A request with no body to another `/v1/*` path, to a replica that never answers, gets a
/// 504 at the first-byte timeout: an upload that was nothing is through at once.
#[tokio::test]
async fn a_bodyless_request_to_a_silent_replica_times_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            connections.push(stream); // read nothing, answer nothing
        }
    });
    let (router, shutdown) = router_in_front_of(silent, |c| kvroute_router::Config {
        first_byte_timeout_ms: 300,
        connect_timeout_ms: 100,
        ..c
    })
    .await;
    let mut stream =
        tokio::net::TcpStream::connect(router.url().trim_start_matches("http://")).await.unwrap();
    stream.write_all(b"GET /v1/files/f1 HTTP/1.1\r\nhost: r\r\n\r\n").await.unwrap();
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(WAIT, stream.read(&mut answer)).await.expect("an answer").unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 504"), "{answer}");
    shutdown.cancel();
    held.abort();
}

/// An empty answer (`Content-Length: 0`) is a whole one: it clears the replica's failures
/// like any other, though nothing of its body is ever read.
#[tokio::test]
async fn an_empty_answer_counts_as_a_success() {
    let (replica, _seen) = recording_replica(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
    let (router, shutdown) = router_in_front_of(replica, |c| c).await;
    let upstream = router.fleet().member("r0").unwrap().upstream;
    let ejection = std::time::Duration::from_secs(60);
    assert!(!upstream.record_failure(2, ejection), "one failure of two");
    let body = serde_json::json!({"model": FLEET_MODEL, "prompt": "empty", "max_tokens": 1}).to_string();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n";
    assert!(exchange(&router.url(), head, &body).await.starts_with("http/1.1 200"));
    assert!(!upstream.record_failure(2, ejection), "the empty answer cleared the first failure");
    shutdown.cancel();
}

/// A replica that stops reading a streamed upload (larger than the sockets' buffers) is not
/// waited on forever: with nothing of the upload taken for the first-byte timeout, the
/// client gets a 504.
#[tokio::test]
async fn a_replica_that_stops_reading_an_upload_times_out() {
    // A small receive buffer: the replica holds little of what it does not read.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(16).unwrap();
    let stuck = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut connections = Vec::new();
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut head = [0u8; 1024];
            let _ = stream.read(&mut head).await; // the head, then nothing more
            connections.push(stream);
        }
    });
    let length = 32 << 20;
    let (router, shutdown) = router_in_front_of(stuck, |c| kvroute_router::Config {
        first_byte_timeout_ms: 300,
        connect_timeout_ms: 100,
        max_body_bytes: length,
        ..c
    })
    .await;
    let stream = tokio::net::TcpStream::connect(router.url().trim_start_matches("http://")).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let upload = tokio::spawn(async move {
        let head =
            format!("POST /v1/audio/transcriptions HTTP/1.1\r\nhost: r\r\ncontent-length: {length}\r\n\r\n");
        write.write_all(head.as_bytes()).await?;
        write.write_all(&vec![b'x'; length]).await
    });
    let mut answer = vec![0u8; 4096];
    let n = tokio::time::timeout(WAIT, read.read(&mut answer)).await.expect("an answer").unwrap();
    let answer = String::from_utf8_lossy(&answer[..n]).to_ascii_lowercase();
    assert!(answer.starts_with("http/1.1 504"), "{answer}");
    assert!(!upload.is_finished(), "the answer came while the upload was stuck, not after it");
    shutdown.cancel();
    upload.abort();
    held.abort();
}
