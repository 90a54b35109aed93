//! Limits and hardening: header size and connection limits on both HTTP servers, prompt
//! and completion bounds at the router, `cache_salt` isolation between tenants, secrets kept
//! out of logs, and the binary's refusals (admin service beyond loopback without a token, bad
//! flags).

use std::io::Write;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvroute_proto::pb::{self, router_admin_client::RouterAdminClient};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use kvroute_replica_agent::publisher::EventFormat;
use kvroute_router::replicas::EngineKind;

use kvroute_router::config::Config as RouterConfig;

use crate::fleet::{FLEET_BLOCK, FLEET_MODEL, Fleet, Reply, agent_config, index_matches, router_config};

/// Sends one raw HTTP/1.1 request on `stream` and returns the response head.
async fn raw_request(stream: &mut TcpStream, head: &str) -> String {
    let exchange = async {
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let mut got = Vec::new();
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = stream.read(&mut buf).await.unwrap();
            assert!(n > 0, "connection closed before a response: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
        String::from_utf8_lossy(&got).into_owned()
    };
    tokio::time::timeout(crate::support::WAIT, exchange).await.expect("a response head in time")
}

fn get_health(extra: &str) -> String {
    format!("GET /health HTTP/1.1\r\nhost: test\r\n{extra}\r\n")
}

async fn status_of(addr: SocketAddr, head: &str) -> String {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let response =
        tokio::time::timeout(Duration::from_secs(10), raw_request(&mut stream, head)).await.unwrap();
    response.lines().next().unwrap_or_default().to_owned()
}

#[tokio::test]
async fn oversized_request_heads_get_431_on_both_servers() {
    let small =
        |name: &str| kvroute_replica_agent::Config { max_header_bytes: 16 * 1024, ..agent_config(name) };
    let fleet = Fleet::with(1, small, |c| kvroute_router::Config { max_header_bytes: 16 * 1024, ..c }).await;
    let big = format!("x-big: {}\r\n", "a".repeat(32 * 1024));
    for addr in [fleet.router.addr, fleet.agent(0).http_addr] {
        assert!(status_of(addr, &get_health("")).await.starts_with("HTTP/1.1 200"), "{addr}");
        assert!(status_of(addr, &get_health(&big)).await.starts_with("HTTP/1.1 431"), "{addr}");
        // 100 fields (with `host`) are served, 101 are too many.
        let fields = |n: usize| -> String { (0..n).map(|i| format!("x-h{i}: v\r\n")).collect() };
        assert!(status_of(addr, &get_health(&fields(99))).await.starts_with("HTTP/1.1 200"), "{addr}");
        assert!(
            status_of(addr, &get_health(&fields(100))).await.starts_with("HTTP/1.1 431"),
            "{addr}: too many headers"
        );
    }
}

/// A connection beyond `--max-connections` waits for a free slot, while the health port
/// (`--health-listen`) still answers: a liveness probe that waited behind the limit would
/// have the router restarted under load.
#[tokio::test]
async fn connections_beyond_the_limit_wait_for_a_free_slot() {
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config {
        max_connections: 2,
        health_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..c
    })
    .await;
    let addr = fleet.router.addr;
    // Two keep-alive connections hold both slots.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        assert!(raw_request(&mut stream, &get_health("")).await.starts_with("HTTP/1.1 200"));
        held.push(stream);
    }
    // A third connection is not served while they are open...
    let mut third = TcpStream::connect(addr).await.unwrap();
    let pending =
        tokio::time::timeout(Duration::from_millis(300), raw_request(&mut third, &get_health(""))).await;
    assert!(pending.is_err(), "served beyond the connection limit");
    let health = fleet.router.health_addr.unwrap();
    for probe in ["/health", "/ready"] {
        let mut stream = TcpStream::connect(health).await.unwrap();
        let request = format!("GET {probe} HTTP/1.1\r\nhost: x\r\n\r\n");
        let answer = tokio::time::timeout(Duration::from_secs(10), raw_request(&mut stream, &request)).await;
        assert!(answer.unwrap().starts_with("HTTP/1.1 200"), "{probe} on the health port");
    }
    // ...and is as soon as one closes.
    drop(held.pop());
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(10), third.read(&mut buf)).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}

/// A request refused for its length takes no turn of round-robin: the next replica in turn
/// still gets the next request (it was skipped for a whole round).
#[tokio::test]
async fn a_refused_request_takes_no_round_robin_turn() {
    let fleet = Fleet::with(2, agent_config, |c| kvroute_router::Config {
        max_prompt_tokens: 32,
        policy: kvroute_router::policy::PolicyKind::RoundRobin,
        ..c
    })
    .await;
    let url = fleet.url("/v1/completions");
    let ask = |prompt: String| json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 1});
    let long = (0..200).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let mut went = Vec::new();
    for i in 0..4 {
        let reply = fleet.http.post(&url, &ask(format!("short {i}"))).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        went.push(reply.header("x-kvroute-replica").unwrap().to_owned());
        assert_eq!(fleet.http.post(&url, &ask(long.clone())).await.status, 400);
    }
    assert!(went.windows(2).all(|w| w[0] != w[1]), "in turn: {went:?}");
}

#[tokio::test]
async fn long_prompts_and_large_max_tokens_get_400_before_forwarding() {
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config {
        max_prompt_tokens: 32,
        max_completion_tokens: 100,
        ..c
    })
    .await;
    let url = fleet.url("/v1/completions");
    let words = |n: usize| (0..n).map(|i| format!("w{i}")).collect::<Vec<_>>().join(" ");
    let long =
        fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": words(200), "max_tokens": 1})).await;
    assert_eq!(long.status, 400);
    assert_eq!(long.json()["error"]["param"], "prompt");
    let batch = json!({"model": FLEET_MODEL, "prompt": [words(20), words(20)], "max_tokens": 1});
    assert_eq!(fleet.http.post(&url, &batch).await.status, 400, "the limit counts every prompt");
    let greedy =
        fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": "hi", "max_tokens": 1000})).await;
    assert_eq!(greedy.status, 400);
    assert_eq!(greedy.json()["error"]["param"], "max_tokens");
    let chat = json!({"model": FLEET_MODEL, "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 101});
    assert_eq!(fleet.http.post(&fleet.url("/v1/chat/completions"), &chat).await.status, 400);
    assert!(fleet.agent(0).engine.resident().is_empty(), "nothing reached the replica");
    let fine =
        fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": words(8), "max_tokens": 100})).await;
    assert_eq!(fine.status, 200);
    // The admin service's Explain says what the proxy would do: refuse it.
    let mut admin =
        kvroute_proto::pb::router_admin_client::RouterAdminClient::connect(fleet.router.admin_url())
            .await
            .unwrap();
    let explain = |prompt: String| kvroute_proto::pb::ExplainRequest {
        path: "/v1/completions".into(),
        body: json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 1}).to_string().into_bytes(),
    };
    let refused = admin.explain(explain(words(200))).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument);
    assert!(refused.message().contains("32"), "{refused:?}");
    assert!(admin.explain(explain(words(8))).await.is_ok());
}

#[tokio::test]
async fn a_stalled_request_body_gets_408_and_gives_back_its_slot() {
    // One in-flight slot: a body that never finishes must not keep it.
    let fleet = Fleet::with(1, agent_config, |c| kvroute_router::Config {
        idle_timeout_ms: 300,
        max_in_flight: 1,
        ..c
    })
    .await;
    let mut stalled = TcpStream::connect(fleet.router.addr).await.unwrap();
    let head = "POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n\
                content-length: 100\r\n\r\n{\"model\":";
    let response =
        tokio::time::timeout(Duration::from_secs(10), raw_request(&mut stalled, head)).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    let url = fleet.url("/v1/completions");
    let fine = fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": "hi", "max_tokens": 2})).await;
    assert_eq!(fine.status, 200, "the slot was given back");
}

/// A LoRA change to a router without `--lora-updates` is refused before its body is read:
/// no `100 Continue` for a body nobody will take.
#[tokio::test]
async fn a_refused_lora_change_is_refused_before_its_body() {
    let fleet = Fleet::start(1).await;
    let mut stream = TcpStream::connect(fleet.router.addr).await.unwrap();
    let head = "POST /v1/load_lora_adapter HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n\
                content-length: 100000\r\nexpect: 100-continue\r\n\r\n";
    let answer = raw_request(&mut stream, head).await;
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
}

fn predicted(reply: &Reply) -> u64 {
    reply.header("x-kvroute-predicted-cached-tokens").and_then(|v| v.parse().ok()).expect("prediction")
}

/// The same prompt under another tenant's salt, or none, never matches a tenant's blocks:
/// predicted and realized cached tokens are both 0.
#[tokio::test]
async fn cache_salt_keeps_tenants_apart() {
    let fleet = Fleet::start(1).await;
    let url = fleet.url("/v1/completions");
    let prompt = (0..40).map(|i| format!("tenant{i}")).collect::<Vec<_>>().join(" ");
    let ask = |salt: Option<&str>| {
        let mut body = json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 1});
        if let Some(salt) = salt {
            body["cache_salt"] = Value::from(salt);
        }
        body
    };
    assert_eq!(fleet.http.post(&url, &ask(Some("tenant-a"))).await.status, 200);
    fleet.index_matches(0).await;
    let again = fleet.http.post(&url, &ask(Some("tenant-a"))).await;
    assert!(predicted(&again) > 0 && again.cached_tokens() > 0, "the tenant hits its own blocks");
    assert_eq!(predicted(&again), again.cached_tokens());
    for other in [Some("tenant-b"), None] {
        let reply = fleet.http.post(&url, &ask(other)).await;
        assert_eq!(reply.status, 200);
        assert_eq!((predicted(&reply), reply.cached_tokens()), (0, 0), "salt {other:?}");
        fleet.index_matches(0).await;
    }
}

/// A replica publishing in vLLM's format names a request's adapter and salt the way vLLM
/// does (`lora_name`, `extra_keys`), and so does its snapshot. The router recomputes every
/// block's hash from the tokens and that namespace, so its index holds exactly the replica's
/// blocks, and each namespace hits only its own; a router that joins later, from a snapshot
/// (no replay endpoint), holds exactly them too.
#[tokio::test]
async fn vllm_events_and_snapshots_carry_the_adapter_and_the_salt() {
    let agent = |name: &str| kvroute_replica_agent::Config {
        event_format: EventFormat::Vllm,
        lora_adapters: vec!["tuned".into()],
        ..agent_config(name)
    };
    let router = |mut config: RouterConfig| {
        for r in &mut config.replicas {
            r.engine = EngineKind::Vllm;
            r.replay = None;
        }
        config.lora_adapters = vec!["tuned".into()];
        config
    };
    let fleet = Fleet::with(1, agent, router).await;
    let url = fleet.url("/v1/completions");
    // Not whole blocks: for a `vllm` replica the router predicts what vLLM reuses, which for
    // a prompt of whole blocks all cached is one block less than the agent (seed 000) reports.
    let prompt = (0..41).map(|i| format!("ns{i}")).collect::<Vec<_>>().join(" ");
    let ask = |model: &str, salt: Option<&str>| {
        let mut body = json!({"model": model, "prompt": prompt, "max_tokens": 1});
        if let Some(salt) = salt {
            body["cache_salt"] = Value::from(salt);
        }
        body
    };
    let namespaces = [(FLEET_MODEL, Some("tenant-a")), ("tuned", None), ("tuned", Some("tenant-a"))];
    for (model, salt) in namespaces {
        let first = fleet.http.post(&url, &ask(model, salt)).await;
        assert_eq!((first.status.as_u16(), predicted(&first)), (200, 0), "{model} {salt:?} is new");
        fleet.index_matches(0).await;
        let again = fleet.http.post(&url, &ask(model, salt)).await;
        assert!(again.cached_tokens() > 0, "{model} {salt:?} hits its own blocks");
        assert_eq!(predicted(&again), again.cached_tokens(), "{model} {salt:?}");
    }
    let late = router(router_config(std::slice::from_ref(fleet.agent(0))));
    let late = kvroute_router::start(late, fleet.shutdown.child_token()).await.expect("router starts");
    index_matches(&late, fleet.agent(0)).await;
}

/// With `--eagle`, a vLLM replica's hit is predicted one block short: vLLM computes a hit's
/// last block again for the draft head. (The agent reuses every block it holds, so it
/// reports one block more than such a replica would.)
#[tokio::test]
async fn eagle_replicas_are_predicted_one_block_short() {
    let agent =
        |name: &str| kvroute_replica_agent::Config { event_format: EventFormat::Vllm, ..agent_config(name) };
    let router = |mut config: RouterConfig| {
        for r in &mut config.replicas {
            r.engine = EngineKind::Vllm;
            r.replay = None;
        }
        config.eagle = true;
        config
    };
    let fleet = Fleet::with(1, agent, router).await;
    let url = fleet.url("/v1/completions");
    // 41 tokens: whole blocks and a part of one.
    let prompt = (0..41).map(|i| format!("eagle{i}")).collect::<Vec<_>>().join(" ");
    let body = json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 1});
    let first = fleet.http.post(&url, &body).await;
    assert_eq!((first.status.as_u16(), predicted(&first)), (200, 0));
    fleet.index_matches(0).await;
    let again = fleet.http.post(&url, &body).await;
    let block = u64::from(FLEET_BLOCK);
    assert_eq!(again.cached_tokens(), 41 / block * block, "the agent reuses every whole block");
    assert_eq!(predicted(&again), again.cached_tokens() - block, "vLLM with EAGLE one fewer");
}

/// A `MakeWriter` into a shared buffer.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// The admin token and clients' `authorization` headers appear in no log line, at debug
/// level, across a router start, proxied requests (good and failing) and admin calls.
///
/// The check runs in a process of its own ([`secrets_never_appear_in_logs_inner`]) so its
/// subscriber is the global one: tracing caches each log statement's interest per process,
/// and tests starting routers on other threads at the same time could otherwise leave some
/// statements cached as disabled.
/// Set for the child process of [`secrets_never_appear_in_logs`].
const CHILD: &str = "KVROUTE_TEST_SECRETS_CHILD";

#[test]
fn secrets_never_appear_in_logs() {
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["limits::secrets_never_appear_in_logs_inner", "--exact", "--ignored", "--test-threads=1"])
        .env_remove("RUST_LOG")
        .env(CHILD, "1")
        .output()
        .expect("run the test binary");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("1 passed"), "the inner test ran: {stdout}");
}

#[tokio::test(flavor = "current_thread")]
#[ignore = "run by secrets_never_appear_in_logs in a process of its own"]
async fn secrets_never_appear_in_logs_inner() {
    if std::env::var_os(CHILD).is_none() {
        return; // `--include-ignored` in a shared process: only the child may own the subscriber.
    }
    const ADMIN: &str = "admin-token-8d1f3c";
    const CLIENT: &str = "client-key-5e2a7b";
    const REPLICA: &str = "replica-key-91c4d0";
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_writer(captured.clone())
        .with_ansi(false)
        .finish();
    tracing::subscriber::set_global_default(subscriber).expect("the only subscriber of this process");

    let fleet = Fleet::with(2, agent_config, |c| kvroute_router::Config {
        admin_token: Some(ADMIN.into()),
        replica_api_key: Some(kvroute_router::config::Secret::new(REPLICA)),
        access_log: true,
        ..c
    })
    .await;
    tracing::debug!(config = ?kvroute_router::Config { admin_token: Some(ADMIN.into()), replica_api_key: Some(kvroute_router::config::Secret::new(REPLICA)), ..kvroute_router::Config::default() }, "a config in a log line");
    let client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new()).build_http();
    let body = json!({"model": FLEET_MODEL, "prompt": "a secret-free prompt", "max_tokens": 2}).to_string();
    for (i, (path, body)) in [
        ("/v1/completions", body.clone()),
        ("/v1/completions", "{not json".to_owned()),
        ("/v1/nope", String::new()),
        ("/v1/models", String::new()),
    ]
    .into_iter()
    .enumerate()
    {
        let request = http::Request::post(fleet.url(path))
            .header("x-request-id", format!("logged-{}", i + 1))
            .header("authorization", format!("Bearer {CLIENT}"))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .unwrap();
        let response = client.request(request).await.unwrap();
        http_body_util::BodyExt::collect(response.into_body()).await.unwrap();
    }
    let mut admin = RouterAdminClient::connect(fleet.router.admin_url()).await.unwrap();
    for token in ["wrong-token", ADMIN] {
        let mut request = tonic::Request::new(pb::ListReplicasRequest {});
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
        drop(admin.list_replicas(request).await);
    }
    drop(fleet);
    // A replica whose answer has no body (`Content-Length: 0`): the response ends complete.
    let replica = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = replica.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut stream, _)) = replica.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                if let Ok(1..) = stream.read(&mut request).await {
                    let empty = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                    stream.write_all(empty).await.ok();
                }
            });
        }
    });
    let (router, stop) =
        crate::proxy::router_in_front_of(addr, |c| kvroute_router::Config { access_log: true, ..c }).await;
    let request = http::Request::post(format!("{}/v1/completions", router.url()))
        .header("x-request-id", "logged-empty")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(body.clone())))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    http_body_util::BodyExt::collect(response.into_body()).await.unwrap();
    stop.cancel();
    // A request whose client left before its answer began: the replica holds it unanswered.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let (got, mut arrived) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        let mut held = Vec::new();
        while let Ok((mut stream, _)) = silent.accept().await {
            let mut request = [0u8; 4096];
            if let Ok(n @ 1..) = stream.read(&mut request).await
                && request[..n].starts_with(b"POST ")
            {
                got.send(()).ok();
            }
            held.push(stream);
        }
    });
    let (router, stop) =
        crate::proxy::router_in_front_of(addr, |c| kvroute_router::Config { access_log: true, ..c }).await;
    let mut leaving = TcpStream::connect(router.addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: r\r\nx-request-id: logged-gone\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    leaving.write_all(head.as_bytes()).await.unwrap();
    tokio::time::timeout(crate::support::WAIT, arrived.recv())
        .await
        .expect("in time")
        .expect("at the replica");
    drop(leaving);
    let logged = || String::from_utf8_lossy(&captured.0.lock().unwrap()).contains("logged-gone");
    crate::support::wait_until("the abandoned request's line", logged).await;
    stop.cancel();

    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("router started"), "the capture works: {logs}");
    // The access log: a line for each request, forwarded or refused, with its request id.
    let access: Vec<&str> = logs.lines().filter(|l| l.contains("kvroute_router::access")).collect();
    for (id, fields) in [
        (
            "logged-1",
            &[
                "status=200",
                "client=127.0.0.1:",
                "path=\"/v1/completions\"",
                "attempt=1",
                &format!("model=\"{FLEET_MODEL}\""),
                "end=\"complete\"",
                "cached_tokens=0",
                "ttfb_ms=",
            ][..],
        ),
        ("logged-2", &["status=400", "error=\"bad_request\"", "client=127.0.0.1:"]),
        ("logged-3", &["status=404", "replica=", "end=\"complete\""]),
        ("logged-gone", &["status=499", "end=\"abandoned\"", "client=127.0.0.1:"]),
        ("logged-empty", &["status=200", "replica=\"r0\"", "end=\"complete\""]),
    ] {
        let line =
            access.iter().find(|l| l.contains(id)).unwrap_or_else(|| panic!("no line for {id}: {access:?}"));
        for field in fields {
            assert!(line.contains(field), "{id}: {field} not in {line}");
        }
    }
    assert!(logs.contains("a config in a log line"));
    for secret in [ADMIN, CLIENT, REPLICA] {
        assert!(!logs.contains(secret), "{secret} was logged:\n{logs}");
    }
}

/// Runs the router binary with `args` (its listeners on port 0 unless `args` set them) and
/// returns its exit code and what it printed; fails if it did not exit (it took the flags).
fn refused_by_router(args: &[&str]) -> (Option<i32>, String) {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_kvroute-router"));
    command.args(args).env_remove("KVROUTE_ADMIN_TOKEN").env_remove("KVROUTE_CONFIG");
    for listener in ["--listen", "--admin-listen"] {
        if !args.contains(&listener) {
            command.args([listener, "127.0.0.1:0"]);
        }
    }
    let out = kvroute_proto::exits::output_within(command, crate::support::WAIT)
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn the_binary_refuses_an_admin_service_beyond_loopback_without_a_token() {
    let (code, stderr) = refused_by_router(&["--admin-listen", "0.0.0.0:0"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--admin-token"), "{stderr}");
}

#[test]
fn bad_flags_make_the_binary_exit_with_a_message() {
    for (args, fragment) in [
        (&["--bogus-flag"][..], "'--bogus-flag'"),
        (&["--max-in-flight", "many"], "'many' for '--max-in-flight"),
        (&["--policy", "fastest"], "'fastest' for '--policy"),
        (&["--listen", "not-an-address"], "'not-an-address' for '--listen"),
        (&["--replica", "name=r0"], "missing field `http`"),
        (&["--max-header-bytes", "100"], "--max-header-bytes must be at least 8192"),
        (&["--control-timeout-ms", "0"], "--control-timeout-ms must be at least 1"),
        (&["--queue-timeout-ms", "3600001"], "--queue-timeout-ms must be at most 3600000"),
        (&["--max-queued", "2000000"], "--max-queued must be at most 1048576"),
        (&["--response-owners", "0"], "--response-owners must be at least 1"),
        (&["--miss-weight", "1e300"], "--miss-weight must be between 0 and 1e6, got 1e300"),
        (&["--offload-weight=-1"], "--offload-weight must be between 0 and 1e6, got -1.0"),
        (&["--config", "/nonexistent/router.toml"], "/nonexistent/router.toml"),
    ] {
        let (code, stderr) = refused_by_router(args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(fragment), "{args:?}: {fragment:?} not in {stderr}");
    }
}

/// A config file with a bad key is reported together with what the checks find in the
/// rest, so one run names every problem.
#[test]
fn a_bad_config_file_is_reported_with_the_rests_problems() {
    let path = std::env::temp_dir().join(format!("kvroute-router-bad-file-{}.toml", std::process::id()));
    std::fs::write(&path, "max-header-bytes = 100\nbogus-key = 1\nmax-queued = \"many\"\n").unwrap();
    let (code, stderr) =
        refused_by_router(&["--config", path.to_str().unwrap(), "--control-timeout-ms", "0"]);
    assert_eq!(code, Some(2), "{stderr}");
    for fragment in [
        "unknown keys: bogus-key",
        "max-queued:",
        "--max-header-bytes must be at least 8192",
        "--control-timeout-ms must be at least 1",
    ] {
        assert!(stderr.contains(fragment), "{fragment:?} not in {stderr}");
    }
    // A check of a key the file got wrong is left out: it saw the default, not the file's.
    std::fs::write(&path, "admin-token = 123\n").unwrap();
    let (code, stderr) =
        refused_by_router(&["--config", path.to_str().unwrap(), "--admin-listen", "0.0.0.0:0"]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("admin-token:"), "{stderr}");
    assert!(!stderr.contains("--admin-token is required"), "{stderr}");
}

/// A stream holds its in-flight slot until it ends: with one slot, a request made while a
/// stream is open gets 503, and one made after it ended is served.
#[tokio::test]
async fn an_open_stream_holds_its_in_flight_slot() {
    let slow = |name: &str| kvroute_replica_agent::Config {
        time_scale: 1.0,
        step_base_us: 200_000,
        ..agent_config(name)
    };
    // Without a line to wait in (`--queue-timeout-ms 0`): the waits are `queue`'s tests.
    let fleet =
        Fleet::with(1, slow, |c| kvroute_router::Config { max_in_flight: 1, queue_timeout_ms: 0, ..c }).await;
    let url = fleet.url("/v1/completions");
    let streaming = json!({"model": FLEET_MODEL, "prompt": "hold it", "max_tokens": 8, "stream": true});
    let open = fleet.http.stream(&url, &streaming).await;
    assert_eq!(open.status(), 200);
    let refused =
        fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": "hi", "max_tokens": 1})).await;
    assert_eq!(refused.status, 503, "{}", String::from_utf8_lossy(&refused.body));
    assert!(refused.json()["error"]["message"].as_str().unwrap().contains("in-flight limit"));
    let other = fleet.http.get(&fleet.url("/v1/anything")).await;
    assert_eq!(other.status, 503, "other /v1/* requests count too");
    let text = String::from_utf8(
        http_body_util::BodyExt::collect(open.into_body()).await.unwrap().to_bytes().to_vec(),
    )
    .unwrap();
    assert!(text.contains("[DONE]"), "{text}");
    let after = fleet.http.post(&url, &json!({"model": FLEET_MODEL, "prompt": "hi", "max_tokens": 1})).await;
    assert_eq!(after.status, 200, "the slot was given back when the stream ended");
}

/// A router given `--replica-api-key` but no key of its own (nor clients' certificates to
/// check) says that it opens the replicas to every client; the key itself is not in its logs.
#[tokio::test]
async fn a_replicas_key_without_client_keys_is_warned_of() {
    let (replica, _seen) =
        crate::headers::recording_replica(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
    let port = kvroute_proto::loopback_port::unused().unwrap();
    let spec = format!("name=r0,http=http://{replica},events={},engine=kvroute", crate::support::nowhere());
    let args = ["--model", FLEET_MODEL, "--replica", &spec].map(std::ffi::OsStr::new);
    let env = [("KVROUTE_REPLICA_API_KEY", "sk-fleet-secret"), ("RUST_LOG", "info")];
    let (mut router, logs, reader) = crate::support::router_process(port, &args, &env);
    let logged = || String::from_utf8_lossy(&logs.lock().unwrap()).contains("router started");
    crate::support::wait_until("the router started", logged).await;
    router.kill().await.unwrap();
    tokio::time::timeout(crate::support::WAIT, reader).await.expect("the pipe closed").unwrap();
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(text.contains("every client reaches the replicas with their key"), "{text}");
    assert!(!text.contains("sk-fleet-secret"), "{text}");
}

/// `KVROUTE_LOG_FORMAT=json` makes the binary's every log line a JSON object, the access log's
/// included, with its fields (a log pipeline reads them without parsing text).
#[tokio::test]
async fn json_logs_are_one_object_a_line() {
    let (replica, _seen) = crate::headers::recording_replica(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await;
    let port = kvroute_proto::loopback_port::unused().unwrap();
    let spec = format!("name=r0,http=http://{replica},events={},engine=kvroute", crate::support::nowhere());
    let args = ["--access-log", "--model", FLEET_MODEL, "--replica", &spec].map(std::ffi::OsStr::new);
    let env = [("KVROUTE_LOG_FORMAT", "json"), ("RUST_LOG", "info")];
    let (mut router, logs, reader) = crate::support::router_process(port, &args, &env);
    let http = crate::fleet::Http::new();
    let url = format!("http://127.0.0.1:{port}");
    crate::support::wait_until_async("the router serves", async || {
        TcpStream::connect(("127.0.0.1", port)).await.is_ok()
    })
    .await;
    let headers = [("x-request-id", "json-1")];
    let reply = http
        .send_with(http::Method::POST, &format!("{url}/v1/embeddings"), "{\"input\":\"x\"}", &headers)
        .await;
    assert_eq!(reply.status, 200);
    let logged = || String::from_utf8_lossy(&logs.lock().unwrap()).contains("json-1");
    crate::support::wait_until("the access log line", logged).await;
    router.kill().await.unwrap();
    // Everything written, to the pipe's end: a line is not read half.
    tokio::time::timeout(crate::support::WAIT, reader).await.expect("the pipe closed").unwrap();
    let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let access = lines
        .iter()
        .find(|l| l["fields"]["request_id"] == "json-1")
        .unwrap_or_else(|| panic!("no access line: {text}"));
    assert_eq!(access["target"], "kvroute_router::access");
    assert_eq!(access["fields"]["status"], 200);
    assert_eq!(access["fields"]["replica"], "r0");
    assert_eq!(access["fields"]["path"], "/v1/embeddings");
}

/// With `--api-key`, a request to `/v1/*` needs `Authorization: Bearer` with one of the keys
/// (401 in OpenAI's error shape, or Anthropic's for `/v1/messages`, without); the paths outside
/// `/v1` and a browser's preflight stay open, as with vLLM. The key goes on to the replica.
#[tokio::test]
async fn api_keys_guard_the_v1_paths() {
    let keys = vec!["sk-one".into(), "sk-two".into()];
    // The replica checks one of the keys itself: a request it serves had the key passed on.
    let checking =
        |name: &str| kvroute_replica_agent::Config { api_key: Some("sk-two".into()), ..agent_config(name) };
    let fleet = Fleet::with(1, checking, |c| kvroute_router::Config { api_key: keys, ..c }).await;
    let completion = json!({"model": FLEET_MODEL, "prompt": "hi", "max_tokens": 1}).to_string();
    let post = |path: &'static str, headers: &'static [(&'static str, &'static str)]| {
        let (http, url, body) = (fleet.http.clone(), fleet.url(path), completion.clone());
        async move { http.send_with(http::Method::POST, &url, body, headers).await }
    };
    for wrong in [&[][..], &[("authorization", "Bearer sk-three")], &[("authorization", "sk-one")]] {
        let refused = post("/v1/completions", wrong).await;
        assert_eq!(refused.status, 401, "{wrong:?}");
        let error = &refused.json()["error"];
        assert_eq!(
            (error["type"].as_str(), error["code"].as_str()),
            (Some("invalid_request_error"), Some("invalid_api_key"))
        );
        assert!(refused.header("x-request-id").is_some());
    }
    let served = post("/v1/completions", &[("authorization", "Bearer sk-two")]).await;
    assert_eq!(served.status, 200, "{}", String::from_utf8_lossy(&served.body));
    let anthropic = post("/v1/messages", &[]).await;
    assert_eq!((anthropic.status.as_u16(), anthropic.json()["type"].as_str()), (401, Some("error")));
    assert_eq!(fleet.http.get(&fleet.url("/v1/models")).await.status, 401, "the router's own /v1 answer too");
    // The router's LoRA paths reach every replica: SGLang's spelling outside `/v1` is guarded.
    assert_eq!(post("/load_lora_adapter", &[]).await.status, 401);
    for open in ["/health", "/metrics"] {
        assert_eq!(fleet.http.get(&fleet.url(open)).await.status, 200, "{open}");
    }
    let preflight = fleet
        .http
        .send_with(
            http::Method::OPTIONS,
            &fleet.url("/v1/completions"),
            "",
            &[("origin", "https://app.example"), ("access-control-request-method", "POST")],
        )
        .await;
    assert_ne!(preflight.status, 401, "a preflight carries no credentials");
}

/// With `--replica-api-key`, clients hold the router's keys and the replicas their own: a
/// request reaches its replica with the replicas' key in place of the client's, the replicas'
/// key is no client's, and the router's own requests carry it too (it learns an adapter from a
/// keyed replica's list). Without it, the client's key goes on, and the replica refuses it.
#[tokio::test]
async fn the_replicas_key_replaces_the_clients() {
    let keyed = |name: &str| kvroute_replica_agent::Config {
        api_key: Some("sk-replica".into()),
        ..agent_config(name)
    };
    let completion = json!({"model": FLEET_MODEL, "prompt": "hi", "max_tokens": 1}).to_string();
    let status = async |fleet: &Fleet, key: &str| {
        let auth = format!("Bearer {key}");
        let url = fleet.url("/v1/completions");
        fleet
            .http
            .send_with(http::Method::POST, &url, completion.clone(), &[("authorization", &auth)])
            .await
            .status
    };
    let fleet = Fleet::with(1, keyed, |c| kvroute_router::Config {
        api_key: vec!["sk-client".into()],
        replica_api_key: Some(kvroute_router::config::Secret::new("sk-replica")),
        ..c
    })
    .await;
    assert_eq!(status(&fleet, "sk-client").await, 200);
    assert_eq!(status(&fleet, "sk-replica").await, 401, "the router's keys are its clients'");
    let agent = fleet.agents[0].as_ref().unwrap().http_url();
    let load = json!({"lora_name": "sql", "lora_path": "/adapters/sql"});
    let loaded = crate::fleet::Http::new()
        .bearer("sk-replica")
        .post(&format!("{agent}/v1/load_lora_adapter"), &load)
        .await;
    assert_eq!(loaded.status, 200, "{:?}", loaded.body);
    let state = fleet.router.state.clone();
    crate::support::wait_until("the router learned the adapter from the keyed list", || {
        state.decider.prompts.tokenization().lora_adapters().contains(&"sql".to_owned())
    })
    .await;

    let passing =
        Fleet::with(1, keyed, |c| kvroute_router::Config { api_key: vec!["sk-client".into()], ..c }).await;
    assert_eq!(status(&passing, "sk-client").await, 401, "the replica's answer to the client's key");
}

/// `--max-in-flight-per-key`: a key whose share is in flight gets 429 at once; other keys go
/// on, and the key's place comes back when its answer ends.
#[tokio::test]
async fn a_key_holds_no_more_than_its_share_of_requests() {
    let fleet = crate::fleet::Fleet::with(1, crate::fleet::agent_config, |config| RouterConfig {
        api_key: vec!["sk-a".into(), "sk-b".into()],
        max_in_flight_per_key: 1,
        ..config
    })
    .await;
    let url = fleet.url("/v1/completions");
    let (a, b) = (crate::fleet::Http::new().bearer("sk-a"), crate::fleet::Http::new().bearer("sk-b"));
    let model = crate::fleet::FLEET_MODEL;
    // A's stream holds A's place while its body is unread.
    let long = json!({"model": model, "prompt": "a long answer", "max_tokens": 400, "stream": true});
    let mut streaming = fleet.http.stream_with(&url, &long, &[("authorization", "Bearer sk-a")]).await;
    assert_eq!(streaming.status(), 200);
    crate::fleet::first_data(streaming.body_mut()).await;
    let short = json!({"model": model, "prompt": "short", "max_tokens": 1});
    let refused = a.post(&url, &short).await;
    assert_eq!(refused.status, 429, "{}", String::from_utf8_lossy(&refused.body));
    assert_eq!(refused.header("retry-after"), Some("1"));
    assert_eq!(refused.json()["error"]["code"], "rate_limit_exceeded");
    // Another key goes on, as do SGLang's /generate and passthrough paths of that key's
    // (they take its place too: refused while the stream holds it).
    assert_eq!(b.post(&url, &short).await.status, 200);
    assert_eq!(a.post(&fleet.url("/generate"), &json!({"text": "x"})).await.status, 429);
    // Read to its end, the stream gives its place back.
    use http_body_util::BodyExt;
    streaming.into_body().collect().await.unwrap();
    crate::support::wait_until_async("A's place is back", async || a.post(&url, &short).await.status == 200)
        .await;
    let metrics = fleet.http.get(&fleet.url("/metrics")).await;
    let refusals = crate::support::sample(
        &String::from_utf8_lossy(&metrics.body),
        "kvroute_router_errors_total{kind=\"key_limit\"}",
    );
    assert!(refusals >= Some(2), "{refusals:?}");
}
