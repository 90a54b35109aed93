//! Test harness: the router's ingestion over real sockets on 127.0.0.1 port 0, the replica
//! agent's publisher, a hand-written ZeroMQ publisher that can misbehave, a small gRPC
//! `ReplicaAgent` serving snapshots, seeded workloads, and condition waits.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use kvroute_proto::framing;
use kvroute_proto::pb::replica_agent_server::{ReplicaAgent, ReplicaAgentServer};
use kvroute_proto::pb::{self, EventBatch, event};
use kvroute_proto::{BlockHash, CacheNamespace, Seq};
use kvroute_replica_agent::publisher::{EventFormat, Publisher, PublisherConfig};
use kvroute_router::index::SharedIndex;
use kvroute_router::ingest::{Ingest, IngestConfig, ReplicaMetrics};
use kvroute_router::replicas::{EngineKind, Replica, ReplicaSpec};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use zeromq::prelude::*;
use zeromq::{PubSocket, RouterSocket, ZmqMessage};

pub const MODEL: &str = "test-model";
pub const BLOCK: u32 = 4;

/// Upper bound of every wait; generous because four engineers share two cores.
pub const WAIT: Duration = Duration::from_secs(30);

/// The `kvroute-router` binary, listening on 127.0.0.1:`port` (its admin service on a port
/// of its own), with `args` and `env` and none of the operator's settings from the
/// environment; killed when dropped. Its stderr is gathered as it comes into the returned
/// buffer, by the returned task, which ends at the pipe's end.
pub fn router_process(
    port: u16,
    args: &[&std::ffi::OsStr],
    env: &[(&str, &str)],
) -> (tokio::process::Child, Arc<Mutex<Vec<u8>>>, tokio::task::JoinHandle<()>) {
    use tokio::io::AsyncReadExt;
    let mut router = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvroute-router"))
        .args(["--listen", &format!("127.0.0.1:{port}"), "--admin-listen", "127.0.0.1:0"])
        .args(args)
        .envs(env.iter().copied())
        .env_remove("KVROUTE_CONFIG")
        .env_remove("KVROUTE_REPLICAS")
        .env_remove("KVROUTE_ADMIN_TOKEN")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run kvroute-router");
    let mut stderr = router.stderr.take().expect("stderr is piped");
    let logs = Arc::new(Mutex::new(Vec::new()));
    let kept = logs.clone();
    let reader = tokio::spawn(async move {
        let mut buf = [0u8; 4096];
        while let Ok(n @ 1..) = stderr.read(&mut buf).await {
            kept.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    (router, logs, reader)
}

/// An event endpoint on loopback that nothing listens on (a publisher that never comes):
/// outside the ephemeral range, unlike a fixed low port a CI host may serve.
pub fn nowhere() -> String {
    format!("tcp://127.0.0.1:{}", kvroute_proto::loopback_port::unused().expect("a free port"))
}

/// Polls `cond` until it holds; panics with `what` after [`WAIT`].
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    wait_until_async(what, async || cond()).await;
}

/// [`wait_until`] for a condition that must await (an HTTP call, a routing decision): the one
/// bounded polling loop of the tests, for states no event announces.
pub async fn wait_until_async(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The value of `series` (a metric's name and labels, as the text format prints them).
pub fn sample(metrics: &str, series: &str) -> Option<u64> {
    metrics.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// Ingestion with short timeouts, torn down on drop.
pub struct Harness {
    pub ingest: Ingest,
    pub index: SharedIndex,
    pub registry: Registry,
    pub tracker: TaskTracker,
    pub shutdown: CancellationToken,
}

impl Harness {
    pub fn start() -> Self {
        Self::with_config(test_config())
    }

    pub fn with_config(config: IngestConfig) -> Self {
        Self::with_index(config, SharedIndex::new())
    }

    /// A harness over `index` (one with routing credits, say).
    pub fn with_index(config: IngestConfig, index: SharedIndex) -> Self {
        // Logs show with `RUST_LOG=kvroute_router=debug` (captured per test).
        let filter = tracing_subscriber::EnvFilter::from_default_env();
        drop(tracing_subscriber::fmt().with_env_filter(filter).with_test_writer().try_init());
        let mut registry = Registry::default();
        let tracker = TaskTracker::new();
        let shutdown = CancellationToken::new();
        let ingest = Ingest::start(config, index.clone(), &mut registry, tracker.clone(), shutdown.clone());
        Self { ingest, index, registry, tracker, shutdown }
    }

    pub fn add(&self, spec: ReplicaSpec) -> (Arc<Replica>, ReplicaMetrics) {
        let name = spec.name.clone();
        let replica = self.ingest.add_replica(spec).expect("valid spec");
        (replica, self.ingest.replica_metrics(&name).expect("registered"))
    }

    /// Waits (bounded) for the replica's first sync.
    pub async fn synced(&self, replica: &Replica) {
        let synced = tokio::time::timeout(WAIT, self.ingest.wait_synced(replica.id)).await;
        assert_eq!(synced, Ok(true), "{} never synced", replica.spec.name);
    }

    /// The Prometheus text exposition.
    pub fn scrape(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("encode metrics");
        out
    }

    /// How many leading blocks of `tokens` (default namespace) the replica holds.
    pub fn overlap(&self, replica: &Replica, tokens: &[u32]) -> usize {
        self.index.lookup(&chain(tokens)).get(replica.id)
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
        self.tracker.close();
    }
}

pub fn test_config() -> IngestConfig {
    IngestConfig {
        channel_capacity: 1024,
        channel_max_bytes: 64 << 20,
        fallback_after: Duration::from_secs(2),
        reconnect_backoff: Duration::from_millis(100),
        replay_timeout: Duration::from_secs(5),
        replay_max_batches: 10_000,
        replay_max_bytes: 64 << 20,
        snapshot_timeout: Duration::from_secs(10),
        snapshot_max_blocks: 1 << 20,
        malformed_fallback: 4,
        catch_up_after: Duration::from_millis(200),
        ..IngestConfig::default()
    }
}

pub fn spec(name: &str, engine: EngineKind, events: &str, replay: Option<&str>) -> ReplicaSpec {
    ReplicaSpec {
        replay_endpoint: replay.map(str::to_owned),
        block_size: Some(BLOCK),
        ..ReplicaSpec::new(name, events, engine, MODEL)
    }
}

/// The router chain of `tokens` in the test model's default namespace.
pub fn chain(tokens: &[u32]) -> Vec<BlockHash> {
    CacheNamespace::new(MODEL).chain(tokens, BLOCK as usize)
}

/// Deterministic pseudo-random numbers (splitmix64), so workloads are reproducible.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(kvroute_proto::mix::GOLDEN);
        kvroute_proto::mix::mix64(self.0)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// `blocks` full blocks of token ids.
    pub fn tokens(&mut self, blocks: usize) -> Vec<u32> {
        (0..blocks * BLOCK as usize).map(|_| self.below(50_000) as u32).collect()
    }
}

// ---------------------------------------------------------------------------------------
// Native batches

pub fn stored_event(hashes: &[BlockHash], parent: Option<BlockHash>, tokens: &[u32]) -> pb::Event {
    pb::Event {
        kind: Some(event::Kind::Stored(pb::BlockStored {
            block_hashes: hashes.iter().map(|h| h.0).collect(),
            parent_block_hash: parent.map(|h| h.0),
            token_ids: tokens.to_vec(),
            ..Default::default()
        })),
    }
}

pub fn removed_event(hashes: &[BlockHash]) -> pb::Event {
    pb::Event {
        kind: Some(event::Kind::Removed(pb::BlockRemoved {
            block_hashes: hashes.iter().map(|h| h.0).collect(),
            medium: None,
        })),
    }
}

pub fn cleared_event() -> pb::Event {
    pb::Event { kind: Some(event::Kind::Cleared(pb::AllBlocksCleared {})) }
}

/// Stores `tokens[from_block..]` as one event whose hashes are the router chain.
pub fn store_chain(tokens: &[u32], from_block: usize) -> pb::Event {
    let hashes = chain(tokens);
    let parent = from_block.checked_sub(1).map(|i| hashes[i]);
    stored_event(&hashes[from_block..], parent, &tokens[from_block * BLOCK as usize..])
}

pub fn batch(epoch: u64, seq: u64, events: Vec<pb::Event>) -> EventBatch {
    EventBatch {
        replica: "agent".into(),
        epoch,
        seq,
        ts_unix_nanos: 1_700_000_000_000_000_000 + seq,
        block_size: BLOCK,
        dp_rank: 0,
        events,
    }
}

/// The same batch as a vLLM engine would describe it: every hash replaced by an opaque
/// engine id (`h ^ salt`), so the router must recompute its own hashes from the tokens.
pub fn opaque(mut batch: EventBatch, salt: u64) -> EventBatch {
    for e in &mut batch.events {
        match &mut e.kind {
            Some(event::Kind::Stored(s)) => {
                s.block_hashes.iter_mut().for_each(|h| *h ^= salt);
                s.parent_block_hash = s.parent_block_hash.map(|h| h ^ salt);
            }
            Some(event::Kind::Removed(r)) => r.block_hashes.iter_mut().for_each(|h| *h ^= salt),
            _ => {}
        }
    }
    batch
}

// ---------------------------------------------------------------------------------------
// The replica agent's publisher

/// The agent's publisher on loopback; it stops when dropped.
pub struct AgentPublisher {
    pub publisher: Publisher,
    pub events: String,
    pub replay: Option<String>,
}

impl AgentPublisher {
    pub async fn start(format: EventFormat, with_replay: bool) -> Self {
        let tracker = TaskTracker::new();
        let config = PublisherConfig { format, topic: "kv-events".into(), ..Default::default() };
        let replay = with_replay.then_some("tcp://127.0.0.1:0");
        let (publisher, endpoints) =
            Publisher::bind(config, "tcp://127.0.0.1:0", replay, &tracker).await.expect("bind publisher");
        Self { publisher, events: endpoints.events, replay: endpoints.replay }
    }

    pub async fn publish(&self, batch: EventBatch) {
        assert!(self.publisher.publish(batch).await, "publisher stopped");
    }
}

// ---------------------------------------------------------------------------------------
// A hand-written publisher that can misbehave

/// Publishers of a replica's first two data-parallel ranks, on adjacent ports (rank r
/// publishes on port + r, as vLLM offsets them); tried again until two are free.
pub async fn rank_publishers() -> (FakePublisher, FakePublisher) {
    // Ports outside the kernel's ephemeral range, never handed out twice in this process: a
    // released ephemeral port could be bound by another test while a router still reconnects
    // to it (a closed rank's stream then never falls back; another's takes its batches).
    for _ in 0..50 {
        let port = kvroute_proto::loopback_port::unused().expect("a free port");
        let Some(next) = port.checked_add(1) else { continue };
        let Some(rank0) = FakePublisher::try_bind(&format!("tcp://127.0.0.1:{port}")).await else { continue };
        if let Some(rank1) = FakePublisher::try_bind(&format!("tcp://127.0.0.1:{next}")).await {
            return (rank0, rank1);
        }
        rank0.close().await;
    }
    panic!("no two adjacent free ports");
}

/// How the fake publisher answers replay requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayLayout {
    /// vLLM >= 0.26 / kvroute: `[b"", topic, seq, payload]`.
    New,
    /// vLLM <= 0.24: `[b"", seq, payload]`.
    Old,
}

type History = Arc<Mutex<VecDeque<(Seq, Bytes)>>>;

/// A PUB socket plus an optional replay ROUTER serving a history the test controls.
pub struct FakePublisher {
    socket: PubSocket,
    pub events: String,
    pub replay: Option<String>,
    history: History,
    topic: Bytes,
    /// While true, replay answers are computed but held back.
    paused: tokio::sync::watch::Sender<bool>,
    /// Most batches one replay answer carries.
    per_answer: Arc<std::sync::atomic::AtomicUsize>,
    /// Whether replay answers end with the end marker.
    ends: Arc<std::sync::atomic::AtomicBool>,
    shutdown: CancellationToken,
}

impl FakePublisher {
    pub async fn start(replay: Option<ReplayLayout>) -> Self {
        Self::bind("tcp://127.0.0.1:0", replay.map(|l| ("tcp://127.0.0.1:0".to_owned(), l))).await
    }

    /// Binds on the given endpoints (retrying briefly: a port just closed may linger).
    pub async fn bind(events: &str, replay: Option<(String, ReplayLayout)>) -> Self {
        let mut socket = PubSocket::new();
        let events = retry_bind(&mut socket, events).await;
        let history: History = Arc::default();
        let topic = Bytes::from_static(b"kv-events");
        let shutdown = CancellationToken::new();
        let paused = tokio::sync::watch::Sender::new(false);
        let per_answer = Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
        let ends = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let replay = match replay {
            None => None,
            Some((endpoint, layout)) => {
                let mut router = RouterSocket::new();
                let bound = retry_bind(&mut router, &endpoint).await;
                let server = ReplayServer {
                    layout,
                    topic: topic.clone(),
                    history: history.clone(),
                    paused: paused.subscribe(),
                    per_answer: per_answer.clone(),
                    ends: ends.clone(),
                };
                tokio::spawn(server.run(router, shutdown.clone()));
                Some(bound)
            }
        };
        Self { socket, events, replay, history, topic, paused, per_answer, ends, shutdown }
    }

    /// Replay answers end without the end marker (a publisher whose send buffer dropped it).
    pub fn drop_end_markers(&self) {
        self.ends.store(false, std::sync::atomic::Ordering::Relaxed);
    }

    /// Replay answers carry at most `n` batches each (then the end marker).
    pub fn limit_replay(&self, n: usize) {
        self.per_answer.store(n, std::sync::atomic::Ordering::Relaxed);
    }

    /// Holds back (or releases) replay answers; what they contain is fixed when the request
    /// arrives.
    pub fn pause_replay(&self, paused: bool) {
        self.paused.send_replace(paused);
    }

    /// One attempt to bind a PUB on `events` (no replay socket); `None` if it is taken.
    pub async fn try_bind(events: &str) -> Option<Self> {
        let mut socket = PubSocket::new();
        let events = socket.bind(events).await.ok()?.to_string();
        Some(Self {
            socket,
            events,
            replay: None,
            history: Arc::default(),
            topic: Bytes::from_static(b"kv-events"),
            paused: tokio::sync::watch::Sender::new(false),
            per_answer: Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX)),
            ends: Arc::new(std::sync::atomic::AtomicBool::new(true)),
            shutdown: CancellationToken::new(),
        })
    }

    /// Publishes `payload` as batch `seq` (and keeps it for replay).
    pub async fn send(&mut self, seq: u64, payload: Bytes) {
        self.keep(seq, payload.clone());
        self.send_frames(framing::encode_live(self.topic.clone(), Seq(seq), payload)).await;
    }

    /// Keeps batch `seq` for replay without publishing it: a batch lost on the way.
    pub fn keep(&self, seq: u64, payload: Bytes) {
        self.history.lock().unwrap().push_back((Seq(seq), payload));
    }

    /// Forgets every buffered batch before `seq` (a replay buffer that wrapped).
    pub fn forget_before(&self, seq: u64) {
        self.history.lock().unwrap().retain(|(s, _)| s.0 >= seq);
    }

    /// Sends arbitrary frames.
    pub async fn send_frames(&mut self, frames: Vec<Bytes>) {
        let msg = ZmqMessage::try_from(frames).expect("non-empty frames");
        self.socket.send(msg).await.expect("PUB send");
    }

    pub async fn close(self) {
        self.shutdown.cancel();
        for e in self.socket.close().await {
            eprintln!("closing the fake PUB: {e}");
        }
    }
}

pub async fn retry_bind<S: Socket>(socket: &mut S, endpoint: &str) -> String {
    let mut last = None;
    for _ in 0..100 {
        match socket.bind(endpoint).await {
            Ok(bound) => return bound.to_string(),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("cannot bind {endpoint}: {last:?}");
}

struct ReplayServer {
    layout: ReplayLayout,
    topic: Bytes,
    history: History,
    paused: tokio::sync::watch::Receiver<bool>,
    per_answer: Arc<std::sync::atomic::AtomicUsize>,
    ends: Arc<std::sync::atomic::AtomicBool>,
}

impl ReplayServer {
    async fn run(mut self, mut router: RouterSocket, shutdown: CancellationToken) {
        loop {
            let msg = tokio::select! {
                () = shutdown.cancelled() => break,
                msg = router.recv() => msg,
            };
            let Ok(msg) = msg else { continue };
            let mut frames = msg.into_vec();
            let identity = frames.remove(0);
            // The router asks in the canonical form (an empty frame, an 8-byte seq), which any
            // vLLM reads; the agent reads more leniently.
            assert!(frames.len() == 2 && frames[0].is_empty() && frames[1].len() == 8, "{frames:?}");
            let start = framing::decode_replay_request(&frames).expect("well-formed replay request");
            let most = self.per_answer.load(std::sync::atomic::Ordering::Relaxed);
            let batches: Vec<_> = self
                .history
                .lock()
                .unwrap()
                .iter()
                .filter(|(s, _)| *s >= start)
                .take(most)
                .cloned()
                .collect();
            tokio::select! {
                () = shutdown.cancelled() => break,
                released = self.paused.wait_for(|p| !*p) => if released.is_err() { break },
            }
            let (layout, topic) = (self.layout, self.topic.clone());
            let end = match layout {
                ReplayLayout::New => framing::encode_replay_end(),
                ReplayLayout::Old => {
                    vec![Bytes::new(), Bytes::copy_from_slice(&u64::MAX.to_be_bytes()), Bytes::new()]
                }
            };
            let replies = batches
                .into_iter()
                .map(|(seq, payload)| match layout {
                    ReplayLayout::New => framing::encode_replay_batch(topic.clone(), seq, payload),
                    ReplayLayout::Old => {
                        vec![Bytes::new(), Bytes::copy_from_slice(&seq.0.to_be_bytes()), payload]
                    }
                })
                .chain(self.ends.load(std::sync::atomic::Ordering::Relaxed).then_some(end));
            for mut reply in replies {
                reply.insert(0, identity.clone());
                if router.send(ZmqMessage::try_from(reply).expect("frames")).await.is_err() {
                    break;
                }
            }
        }
        drop(router.close().await);
    }
}

// ---------------------------------------------------------------------------------------
// A replica agent serving snapshots

/// What the fake agent's `Snapshot` returns.
#[derive(Clone, Debug, Default)]
pub struct SnapshotState {
    pub epoch: u64,
    pub seq: Option<u64>,
    pub blocks: Vec<pb::SnapshotBlock>,
}

#[derive(Clone, Default)]
pub struct FakeAgent {
    pub state: Arc<Mutex<SnapshotState>>,
    pub calls: Arc<Mutex<u32>>,
}

impl FakeAgent {
    /// Serves on 127.0.0.1:0; returns the `http://` endpoint.
    pub async fn serve(&self, shutdown: CancellationToken) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind gRPC");
        let addr = listener.local_addr().expect("local addr");
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let service = ReplicaAgentServer::new(self.clone());
        tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
                .await;
            served.expect("gRPC server");
        });
        format!("http://{addr}")
    }
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::SnapshotChunk, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl ReplicaAgent for FakeAgent {
    async fn info(
        &self,
        _: tonic::Request<pb::InfoRequest>,
    ) -> Result<tonic::Response<pb::InfoResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("info"))
    }

    type SnapshotStream = ChunkStream;

    async fn snapshot(
        &self,
        _: tonic::Request<pb::SnapshotRequest>,
    ) -> Result<tonic::Response<ChunkStream>, tonic::Status> {
        *self.calls.lock().unwrap() += 1;
        let state = self.state.lock().unwrap().clone();
        // Two blocks per chunk, to exercise chunking.
        let mut chunks: Vec<pb::SnapshotChunk> = state
            .blocks
            .chunks(2)
            .enumerate()
            .map(|(i, blocks)| pb::SnapshotChunk {
                epoch: state.epoch,
                seq: state.seq.unwrap_or(0),
                has_seq: state.seq.is_some(),
                block_size: BLOCK,
                chunk: i as u32,
                last: false,
                blocks: blocks.to_vec(),
            })
            .collect();
        if chunks.is_empty() {
            chunks.push(pb::SnapshotChunk {
                epoch: state.epoch,
                seq: state.seq.unwrap_or(0),
                has_seq: state.seq.is_some(),
                block_size: BLOCK,
                ..Default::default()
            });
        }
        chunks.last_mut().expect("one chunk").last = true;
        let stream: ChunkStream = Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)));
        Ok(tonic::Response::new(stream))
    }

    async fn stats(
        &self,
        _: tonic::Request<pb::StatsRequest>,
    ) -> Result<tonic::Response<pb::StatsResponse>, tonic::Status> {
        Err(tonic::Status::unimplemented("stats"))
    }
}

/// Snapshot blocks of `tokens` in the default namespace (parent before child).
pub fn snapshot_blocks(tokens: &[u32]) -> Vec<pb::SnapshotBlock> {
    let hashes = chain(tokens);
    hashes
        .iter()
        .enumerate()
        .map(|(i, h)| pb::SnapshotBlock {
            hash: h.0,
            parent: i.checked_sub(1).map(|p| hashes[p].0),
            token_ids: tokens[i * BLOCK as usize..(i + 1) * BLOCK as usize].to_vec(),
            ..Default::default()
        })
        .collect()
}

/// A temporary directory of the test's own, `name`'s (unique in the test binary).
pub fn directory(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A certificate authority of a test's own: its certificate, and the ones it signs.
pub struct Authority {
    pub cert: rcgen::Certificate,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Authority {
    pub fn new() -> Self {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign];
        let cert = params.self_signed(&key).unwrap();
        Self { cert, issuer: rcgen::Issuer::new(params, key) }
    }

    /// A client's certificate, for `name`.
    pub fn client(&self, name: &str) -> rcgen::CertifiedKey<rcgen::KeyPair> {
        self.sign(name, rcgen::ExtendedKeyUsagePurpose::ClientAuth)
    }

    /// A server's certificate, for `name` (a DNS name or an IP address).
    pub fn server(&self, name: &str) -> rcgen::CertifiedKey<rcgen::KeyPair> {
        self.sign(name, rcgen::ExtendedKeyUsagePurpose::ServerAuth)
    }

    fn sign(&self, name: &str, usage: rcgen::ExtendedKeyUsagePurpose) -> rcgen::CertifiedKey<rcgen::KeyPair> {
        let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        params.extended_key_usages = vec![usage];
        let key = rcgen::KeyPair::generate().unwrap();
        rcgen::CertifiedKey { cert: params.signed_by(&key, &self.issuer).unwrap(), signing_key: key }
    }

    /// Writes this authority's certificate to `dir/{name}.crt`; returns its path.
    pub fn write(&self, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
        let path = dir.join(format!("{name}.crt"));
        std::fs::write(&path, self.cert.pem()).unwrap();
        path
    }
}

/// Writes `made`'s certificate and key to `dir/{name}.crt` and `dir/{name}.key`; returns their
/// paths.
pub fn write_identity(
    made: &rcgen::CertifiedKey<rcgen::KeyPair>,
    dir: &std::path::Path,
    name: &str,
) -> (std::path::PathBuf, std::path::PathBuf) {
    let (cert, key) = (dir.join(format!("{name}.crt")), dir.join(format!("{name}.key")));
    std::fs::write(&cert, made.cert.pem()).unwrap();
    std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
    (cert, key)
}
