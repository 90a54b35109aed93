//! The replica registry: every replica the router knows, its configuration, and the live
//! status the ingest tasks write and the proxy, the policy and the admin API read.
//!
//! Names are interned to compact [`ReplicaId`]s (what the index stores). An id is never
//! reused for another name, so a stale id can never address a different replica; re-adding a
//! removed name gets its old id back. Status fields are atomics: writers (one ingest task per
//! data-parallel rank) never block readers. Later additions (load, health, draining) belong in
//! [`ReplicaStatus`] next to the stream fields.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use kvroute_proto::pb;
use kvroute_proto::{CacheNamespace, Epoch, ReplicaId, Seq};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio::sync::watch;
use tokio_rustls::rustls::pki_types::ServerName;

/// Which event format a replica publishes and whose hashes it uses (spelled `kvroute`,
/// `vllm`, `sglang` in flags and files).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// kvroute's replica agent: protobuf batches whose hashes are the router's own chain.
    Kvroute,
    /// vLLM: msgpack batches; the router recomputes its hashes from `token_ids`.
    Vllm,
    /// SGLang: like vLLM, plus a per-event `cache_salt`.
    Sglang,
}

/// What a replica does when prefill and decode are disaggregated ([`crate::proxy::disagg`];
/// spelled `both`, `prefill`, `decode` in flags, files and the `kvroute.io/role` annotation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Whole requests, and the prefill of another's (the default: a fleet of these routes
    /// whole requests only).
    #[default]
    Both,
    /// Prefills for decode replicas, and takes no whole request.
    Prefill,
    /// Whole requests, and decodes what a prefill replica computed.
    Decode,
}

impl Role {
    /// Whether it takes requests to decode (whole ones included).
    pub fn decodes(self) -> bool {
        self != Role::Prefill
    }

    /// Whether it prefills for a decode replica.
    pub fn prefills(self) -> bool {
        self != Role::Decode
    }

    /// Its spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Both => "both",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl EngineKind {
    /// Whether the engine's block hashes are the router's chain (usable without recomputing).
    pub fn native_hashes(self) -> bool {
        self == EngineKind::Kvroute
    }

    /// What the engine's block hashes are to the router's engine map.
    pub(crate) fn hashes(self) -> crate::ingest::engine_map::Hashes {
        use crate::ingest::engine_map::Hashes;
        match self {
            EngineKind::Kvroute => Hashes::Router,
            EngineKind::Vllm => Hashes::Namespaced,
            EngineKind::Sglang => Hashes::Blind,
        }
    }

    /// Most leading cached blocks the engine reuses for a prompt of `prompt_len` tokens. vLLM
    /// and SGLang must compute the prompt's last token for its logits, so they match at most
    /// `prompt_len - 1` tokens, in whole blocks: a prompt that is all whole blocks, all cached,
    /// recomputes its last block. The replica agent reuses every full block (seed 000).
    pub fn reusable_blocks(self, prompt_len: usize, block_size: usize) -> usize {
        match self {
            EngineKind::Kvroute => usize::MAX,
            EngineKind::Vllm | EngineKind::Sglang => {
                prompt_len.saturating_sub(1).checked_div(block_size).unwrap_or(0)
            }
        }
    }

    /// The leading blocks the engine reuses of the `held` it holds of a prompt of
    /// `prompt_len` tokens ([`EngineKind::reusable_blocks`]). With `eagle` (EAGLE, EAGLE-3 or
    /// MTP speculative decoding), vLLM drops the last block of a hit and computes it again,
    /// for the draft head's hidden states.
    pub fn reused_blocks(self, held: usize, prompt_len: usize, block_size: usize, eagle: bool) -> usize {
        let hit = held.min(self.reusable_blocks(prompt_len, block_size));
        match self {
            EngineKind::Vllm if eagle => hit.saturating_sub(1),
            _ => hit,
        }
    }
}

impl From<EngineKind> for pb::EngineKind {
    fn from(kind: EngineKind) -> Self {
        match kind {
            EngineKind::Kvroute => pb::EngineKind::Kvroute,
            EngineKind::Vllm => pb::EngineKind::Vllm,
            EngineKind::Sglang => pb::EngineKind::Sglang,
        }
    }
}

impl TryFrom<pb::EngineKind> for EngineKind {
    type Error = SpecError;
    fn try_from(kind: pb::EngineKind) -> Result<Self, SpecError> {
        match kind {
            pb::EngineKind::Kvroute => Ok(EngineKind::Kvroute),
            pb::EngineKind::Vllm => Ok(EngineKind::Vllm),
            pb::EngineKind::Sglang => Ok(EngineKind::Sglang),
            pb::EngineKind::Unspecified => Err(SpecError::EngineUnspecified),
        }
    }
}

impl From<Role> for pb::ReplicaRole {
    fn from(role: Role) -> Self {
        match role {
            Role::Both => pb::ReplicaRole::Both,
            Role::Prefill => pb::ReplicaRole::Prefill,
            Role::Decode => pb::ReplicaRole::Decode,
        }
    }
}

impl From<pb::ReplicaRole> for Role {
    fn from(role: pb::ReplicaRole) -> Self {
        match role {
            pb::ReplicaRole::Both => Role::Both,
            pb::ReplicaRole::Prefill => Role::Prefill,
            pb::ReplicaRole::Decode => Role::Decode,
        }
    }
}

/// How exact the router's view of a replica's cache is (see `ingest` for the transitions).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum StreamState {
    /// Every batch since the last sync was applied, in order.
    Exact = 0,
    /// A gap or an outage: a repair is under way or the index may miss blocks.
    Degraded = 1,
    /// No usable stream: the replica is routed without its own cache (as holding what every
    /// replica with a stream holds; see the cache-aware policy).
    Fallback = 2,
    /// The replica has no event stream: its cache is predicted from this router's own
    /// requests to it (`ingest::predicted`). It has one rank.
    Predicted = 3,
}

impl StreamState {
    /// Label value used in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            StreamState::Exact => "exact",
            StreamState::Degraded => "degraded",
            StreamState::Fallback => "fallback",
            StreamState::Predicted => "predicted",
        }
    }

    pub const ALL: [StreamState; 4] =
        [StreamState::Exact, StreamState::Degraded, StreamState::Fallback, StreamState::Predicted];

    fn from_u8(v: u8) -> StreamState {
        match v {
            0 => StreamState::Exact,
            1 => StreamState::Degraded,
            3 => StreamState::Predicted,
            _ => StreamState::Fallback,
        }
    }
}

impl From<StreamState> for pb::StreamState {
    fn from(state: StreamState) -> Self {
        match state {
            StreamState::Exact => pb::StreamState::Exact,
            StreamState::Degraded => pb::StreamState::Degraded,
            StreamState::Fallback => pb::StreamState::Fallback,
            StreamState::Predicted => pb::StreamState::Predicted,
        }
    }
}

/// A replica's configuration: where its HTTP API and event sockets are, and how to read them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaSpec {
    /// Stable name (e.g. the pod name); interned to a [`ReplicaId`].
    pub name: String,
    pub http_url: String,
    /// ZeroMQ PUB endpoint of DP rank 0, e.g. `tcp://10.0.0.7:5557` (rank r uses port + r);
    /// empty for a replica without events, whose cache is predicted ([`Self::has_events`]).
    pub event_endpoint: String,
    /// ZeroMQ ROUTER replay endpoint of rank 0, if the engine has one.
    pub replay_endpoint: Option<String>,
    /// gRPC `ReplicaAgent` endpoint (`http://host:port`) serving `Snapshot`, if any.
    pub grpc_endpoint: Option<String>,
    pub engine: EngineKind,
    /// Data-parallel ranks publishing events (at least 1).
    pub dp_size: u32,
    /// Subscription prefix on frame 0 (empty: everything).
    pub topic: String,
    /// Served model: the cache namespace's model, for router-side hashes.
    pub model: String,
    /// If set, stored events with another block size are skipped (the router hashes
    /// requests with one block size per replica).
    pub block_size: Option<u32>,
    /// Prefill, decode or both ([`Role`]).
    pub role: Role,
    /// An SGLang prefill replica's bootstrap port (`--disaggregation-bootstrap-port`), named
    /// to its decode replicas; `None`: theirs ([`crate::proxy::disagg`]).
    pub bootstrap_port: Option<u16>,
}

impl ReplicaSpec {
    /// Whether it hands a prefill's KV over as SGLang does, through a bootstrap room
    /// ([`crate::proxy::disagg`]), rather than as vLLM's NixlConnector does.
    pub fn bootstraps(&self) -> bool {
        self.engine == EngineKind::Sglang
    }

    /// Whether it is an SGLang decode replica, which serves a completion or chat only with a
    /// bootstrap room (it cannot prefill).
    pub fn waits_for_a_room(&self) -> bool {
        self.bootstraps() && self.role == Role::Decode
    }

    /// Whether it serves SGLang's native `/generate`: SGLang's replicas and kvroute's agent do,
    /// vLLM's do not.
    pub fn serves_generate(&self) -> bool {
        self.engine != EngineKind::Vllm
    }

    /// A single-rank replica with no replay or snapshot endpoint.
    pub fn new(
        name: impl Into<String>,
        event_endpoint: impl Into<String>,
        engine: EngineKind,
        model: impl Into<String>,
    ) -> Self {
        Self {
            name: name.into(),
            http_url: String::new(),
            event_endpoint: event_endpoint.into(),
            replay_endpoint: None,
            grpc_endpoint: None,
            engine,
            dp_size: 1,
            topic: String::new(),
            model: model.into(),
            block_size: None,
            role: Role::Both,
            bootstrap_port: None,
        }
    }

    /// The cache namespace of this replica's un-adapted, unsalted prompts.
    pub fn namespace(&self) -> CacheNamespace {
        CacheNamespace::new(self.model.clone())
    }

    /// Whether the replica publishes KV events. One that does not is routed on a prediction
    /// of its cache from this router's requests (`ingest::predicted`).
    pub fn has_events(&self) -> bool {
        !self.event_endpoint.is_empty()
    }

    /// Checks the endpoints parse and the rank count is sane.
    pub fn validate(&self) -> Result<(), SpecError> {
        match self.problems().into_iter().next() {
            Some(problem) => Err(problem),
            None => Ok(()),
        }
    }

    /// Every problem [`Self::validate`] finds, not just the first.
    pub fn problems(&self) -> Vec<SpecError> {
        let mut problems = Vec::new();
        if self.name.is_empty() {
            problems.push(SpecError::EmptyName);
        }
        if self.dp_size == 0 {
            problems.push(SpecError::NoRanks);
        }
        if self.dp_size > MAX_DP_SIZE {
            problems.push(SpecError::TooManyRanks(self.dp_size));
        }
        // The gRPC client keeps only the endpoint's scheme and authority: a path prefix
        // (a gateway's route) would be dropped without a word, and every snapshot fail.
        match self.grpc_endpoint.as_deref().map(|url| (url, base_url(url))) {
            Some((_, Err(e))) => problems.push(e),
            Some((url, Ok(base)))
                if !base.parse::<http::Uri>().is_ok_and(|u| u.scheme_str() == Some("http")) =>
            {
                problems.push(SpecError::Url(
                    url.to_owned(),
                    "the router speaks plain gRPC to replicas: http://".into(),
                ));
            }
            Some((url, Ok(base))) if base.parse::<http::Uri>().is_ok_and(|u| u.path() != "/") => {
                problems.push(SpecError::Url(url.to_owned(), "a gRPC endpoint takes no path".into()));
            }
            _ => {}
        }
        if !self.has_events() {
            // Ranks are told apart, and repaired, by their streams alone.
            if self.http_url.is_empty() {
                problems.push(SpecError::Nothing);
            }
            if self.dp_size > 1 {
                problems.push(SpecError::NoEvents("dp-size above 1"));
            }
            if self.replay_endpoint.is_some() || self.grpc_endpoint.is_some() {
                problems.push(SpecError::NoEvents("a replay or gRPC endpoint"));
            }
            if !self.topic.is_empty() {
                problems.push(SpecError::NoEvents("a topic"));
            }
            return problems;
        }
        // The last rank's port is the highest; within the ranks allowed.
        let last = self.dp_size.clamp(1, MAX_DP_SIZE) - 1;
        for endpoint in std::iter::once(&self.event_endpoint).chain(&self.replay_endpoint) {
            if let Err(e) = rank_endpoint(endpoint, 0).and_then(|_| rank_endpoint(endpoint, last)) {
                problems.push(e);
            }
        }
        // Every rank offsets both ports (vLLM's and SGLang's publishers do): events on 5557
        // and replay on 5558 collide from rank 1 on, and that rank's engine cannot bind.
        if let Some(replay) = &self.replay_endpoint {
            let ranks = |endpoint: &str| -> Vec<String> {
                (0..=last).filter_map(|rank| rank_endpoint(endpoint, rank).ok()).collect()
            };
            let replays = ranks(replay);
            if let Some(shared) = ranks(&self.event_endpoint).into_iter().find(|e| replays.contains(e)) {
                problems.push(SpecError::RanksOverlap { shared, dp_size: self.dp_size });
            }
        }
        problems
    }
}

/// The endpoint data-parallel rank `rank` uses ([`kvroute_proto::framing::rank_endpoint`]),
/// to connect to: a `tcp://` endpoint must name a host.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, SpecError> {
    if let Some((host, _)) = endpoint.strip_prefix("tcp://").and_then(|rest| rest.rsplit_once(':'))
        && (host.is_empty() || host == "*")
    {
        return Err(SpecError::BindAddress(endpoint.to_owned()));
    }
    kvroute_proto::framing::rank_endpoint(endpoint, rank)
        .ok_or_else(|| SpecError::Endpoint(endpoint.to_owned()))
}

/// Checks a replica's base URL (its OpenAI API, or its gRPC service) and returns it without a
/// trailing `/`: `http://host[:port]` or `https://`, optionally with a path prefix the client's
/// path is appended to, and no query.
pub fn base_url(url: &str) -> Result<String, SpecError> {
    let bad = |why: String| SpecError::Url(url.to_owned(), why);
    let uri: http::Uri = url.parse().map_err(|e: http::uri::InvalidUri| bad(e.to_string()))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(bad("not an http:// or https:// URL".into()));
    }
    if uri.scheme_str() == Some("https")
        && let Some(host) = uri.host()
        && let Err(e) = ServerName::try_from(host.trim_start_matches('[').trim_end_matches(']'))
    {
        return Err(bad(format!("its host is no name a TLS certificate can hold: {e}")));
    }
    // `port()` is `None` for a port that is no u16, so look at what follows the host.
    let port_ok = |a: &http::uri::Authority| {
        let host_port = a.as_str().rsplit_once('@').map_or(a.as_str(), |(_, hp)| hp);
        host_port.strip_prefix(a.host()).is_some_and(|rest| rest.is_empty() || a.port_u16().is_some())
    };
    match uri.authority() {
        Some(a) if !a.host().is_empty() && port_ok(a) => {}
        _ => return Err(bad("no host, or a bad port".into())),
    }
    // The URL is kept as written and the client's path appended, so neither may follow.
    if uri.query().is_some() || url.contains('#') {
        return Err(bad("has a query or a fragment".into()));
    }
    Ok(url.trim_end_matches('/').to_owned())
}

/// Most data-parallel ranks one replica may have (each is an event stream of its own).
pub const MAX_DP_SIZE: u32 = 1024;

/// Why a [`ReplicaSpec`] cannot be used.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SpecError {
    #[error("replica name is empty")]
    EmptyName,
    #[error("dp_size must be at least 1")]
    NoRanks,
    #[error("dp_size {0} is more than {MAX_DP_SIZE} ranks")]
    TooManyRanks(u32),
    #[error("engine kind is unspecified")]
    EngineUnspecified,
    #[error("a replica needs an HTTP address or an event endpoint")]
    Nothing,
    /// What only an event stream serves, on a replica without one.
    #[error("{0} needs an event endpoint (a replica without events is one rank, predicted)")]
    NoEvents(&'static str),
    #[error("unsupported ZeroMQ endpoint {0:?} (expected tcp://host:port or ipc://path)")]
    Endpoint(String),
    #[error("ZeroMQ endpoint {0:?} is a publisher's bind address; give the replica's host to connect to")]
    BindAddress(String),
    #[error("URL {0:?}: {1}")]
    Url(String, String),
    #[error(
        "{shared} is both a rank's event endpoint and a rank's replay endpoint (rank r adds r to \
         both ports, over {dp_size} ranks): move the replay port past the event ports' range"
    )]
    RanksOverlap { shared: String, dp_size: u32 },
    #[error("replica {0:?} is already registered")]
    Duplicate(String),
    /// Two names for one server would split its load (each limit doubled) and its cache's
    /// credit between them.
    #[error("replica {name:?} has the HTTP address of replica {other:?} ({url}): one server is one replica")]
    SameServer { name: String, other: String, url: String },
    /// Two replicas on one event stream would each be credited with the other's cache.
    #[error(
        "replica {name:?} follows the event stream of replica {other:?} ({}): one stream is one replica's",
        stream_named(endpoint, topics)
    )]
    SameStream { name: String, other: String, endpoint: String, topics: (String, String) },
}

/// The event streams (each rank's endpoint, with the topic) a replica follows. Endpoints on
/// port 0 (never connected to) and ranks past the first bad endpoint are left out.
pub(crate) fn event_streams<'a>(
    events: &'a str,
    dp_size: u32,
    topic: &'a str,
) -> impl Iterator<Item = (String, &'a str)> + 'a {
    (0..dp_size.min(MAX_DP_SIZE))
        .map_while(move |rank| rank_endpoint(events, rank).ok())
        .filter(|endpoint| !endpoint.ends_with(":0"))
        .map(move |endpoint| (endpoint, topic))
}

/// An overlap of two replicas' streams, for an error: the endpoint, and the topics when they
/// differ (one begins the other).
pub(crate) fn stream_named(endpoint: &str, (ours, theirs): &(String, String)) -> String {
    match ours == theirs {
        true => endpoint.to_owned(),
        false => format!(
            "{endpoint}, topics {ours:?} and {theirs:?}: a subscription takes every topic its own begins"
        ),
    }
}

/// Whether two of [`event_streams`] overlap: one endpoint, and a topic that begins the other
/// (a subscription takes every topic its own begins, the empty one all of them).
pub(crate) fn one_stream((a, a_topic): &(String, &str), (b, b_topic): &(String, &str)) -> bool {
    one_endpoint(a, b) && (a_topic.starts_with(b_topic) || b_topic.starts_with(a_topic))
}

/// Whether two event endpoints name one socket: a TCP host is case-insensitive
/// (`tcp://H:1` is `tcp://h:1`); an `ipc://` path is not.
fn one_endpoint(a: &str, b: &str) -> bool {
    match (a.strip_prefix("tcp://"), b.strip_prefix("tcp://")) {
        (Some(a), Some(b)) => a.eq_ignore_ascii_case(b),
        _ => a == b,
    }
}

/// The server an HTTP address names, spelled one way: `http://H:80/` and `http://h` are one
/// server (scheme and host are case-insensitive, a default port may be left out, and a
/// trailing slash says nothing). An address that does not parse is taken as written.
pub(crate) fn server_of(url: &str) -> String {
    let trimmed = url.trim_end_matches('/');
    let Ok(uri) = trimmed.parse::<http::Uri>() else { return trimmed.to_owned() };
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return trimmed.to_owned();
    };
    let scheme = scheme.to_ascii_lowercase();
    let default = if scheme == "https" { 443 } else { 80 };
    let port = authority.port_u16().unwrap_or(default);
    let host = authority.host().to_ascii_lowercase();
    let path = uri.path_and_query().map_or("", |pq| pq.as_str()).trim_end_matches('/');
    format!("{scheme}://{host}:{port}{path}")
}

const NO_SEQ: u64 = u64::MAX;

/// Live per-replica status, written by the ingest tasks.
#[derive(Debug)]
pub struct ReplicaStatus {
    /// Stream state of each data-parallel rank (a [`StreamState`] as `u8`).
    ranks: Box<[AtomicU8]>,
    rank_synced: Box<[AtomicBool]>,
    synced: watch::Sender<bool>,
    epoch: AtomicU64,
    last_seq: AtomicU64,
    events_applied: AtomicU64,
    events_malformed: AtomicU64,
    gaps: AtomicU64,
}

impl ReplicaStatus {
    fn new(dp_size: u32) -> Self {
        let n = dp_size.max(1) as usize;
        Self {
            ranks: (0..n).map(|_| AtomicU8::new(StreamState::Degraded as u8)).collect(),
            rank_synced: (0..n).map(|_| AtomicBool::new(false)).collect(),
            synced: watch::Sender::new(false),
            epoch: AtomicU64::new(0),
            last_seq: AtomicU64::new(NO_SEQ),
            events_applied: AtomicU64::new(0),
            events_malformed: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
        }
    }

    /// The replica's state: the worst over its ranks.
    pub fn state(&self) -> StreamState {
        self.ranks
            .iter()
            .map(|r| StreamState::from_u8(r.load(Ordering::Relaxed)))
            .max()
            .unwrap_or(StreamState::Fallback)
    }

    /// One rank's state.
    pub fn rank_state(&self, rank: u32) -> Option<StreamState> {
        self.ranks.get(rank as usize).map(|r| StreamState::from_u8(r.load(Ordering::Relaxed)))
    }

    /// Sets one rank's state; returns the replica's previous and new aggregate state.
    pub fn set_rank_state(&self, rank: u32, state: StreamState) -> (StreamState, StreamState) {
        let before = self.state();
        if let Some(r) = self.ranks.get(rank as usize) {
            r.store(state as u8, Ordering::Relaxed);
        }
        (before, self.state())
    }

    /// True once every rank completed its first sync (the router's `/ready` waits for it).
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Marks one rank synced; the replica is synced once all its ranks are.
    pub fn mark_rank_synced(&self, rank: u32) {
        if let Some(r) = self.rank_synced.get(rank as usize) {
            r.store(true, Ordering::Relaxed);
        }
        if self.rank_synced.iter().all(|r| r.load(Ordering::Relaxed)) {
            self.synced.send_if_modified(|s| !std::mem::replace(s, true));
        }
    }

    /// Waits until the replica completed its first sync.
    pub async fn wait_synced(&self) {
        let mut rx = self.synced.subscribe();
        // The sender lives as long as `self`, so this cannot fail while we borrow it.
        if rx.wait_for(|synced| *synced).await.is_err() {
            tracing::debug!("replica status dropped while waiting for sync");
        }
    }

    pub fn epoch(&self) -> Epoch {
        Epoch(self.epoch.load(Ordering::Relaxed))
    }

    pub fn set_epoch(&self, epoch: Epoch) {
        self.epoch.store(epoch.0, Ordering::Relaxed);
    }

    /// Seq of the newest batch applied (any rank), if any.
    pub fn last_seq(&self) -> Option<Seq> {
        let v = self.last_seq.load(Ordering::Relaxed);
        (v != NO_SEQ).then_some(Seq(v))
    }

    pub fn set_last_seq(&self, seq: Seq) {
        self.last_seq.store(seq.0, Ordering::Relaxed);
    }

    pub fn events_applied(&self) -> u64 {
        self.events_applied.load(Ordering::Relaxed)
    }

    pub fn add_events_applied(&self, n: u64) {
        self.events_applied.fetch_add(n, Ordering::Relaxed);
    }

    pub fn events_malformed(&self) -> u64 {
        self.events_malformed.load(Ordering::Relaxed)
    }

    pub fn add_malformed(&self) {
        self.events_malformed.fetch_add(1, Ordering::Relaxed);
    }

    pub fn gaps(&self) -> u64 {
        self.gaps.load(Ordering::Relaxed)
    }

    pub fn add_gap(&self) {
        self.gaps.fetch_add(1, Ordering::Relaxed);
    }
}

/// One registered replica.
#[derive(Debug)]
pub struct Replica {
    pub id: ReplicaId,
    /// A hash of its name: what ties between replicas are broken by, alike in every router
    /// (`id` is this router's numbering; [`crate::policy::ReplicaView::tie`]).
    pub tie: u64,
    pub spec: ReplicaSpec,
    pub status: ReplicaStatus,
    /// The scheme and authority of `spec.http_url` when that URL has no path: a request's URL
    /// on the replica is then these and the client's path, put together without parsing.
    pub origin: Option<(http::uri::Scheme, http::uri::Authority)>,
    /// With several data-parallel ranks: which blocks each holds (set by the ingest, which
    /// keeps it; [`crate::index::Ranks`]).
    pub ranks: std::sync::OnceLock<Arc<crate::index::Ranks>>,
    /// Without events: the prediction of its cache that its requests feed (set by the
    /// ingest).
    pub prediction: std::sync::OnceLock<Arc<crate::ingest::Prediction>>,
}

/// The registry: a cheap, cloneable handle.
#[derive(Clone, Debug, Default)]
pub struct Replicas {
    inner: Arc<RwLock<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    /// Every name ever seen → its id (never reassigned).
    ids: HashMap<String, ReplicaId>,
    live: HashMap<ReplicaId, Arc<Replica>>,
}

impl Replicas {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `spec` under its name's id. Fails if the spec is invalid or the name is
    /// already registered.
    pub fn insert(&self, spec: ReplicaSpec) -> Result<Arc<Replica>, SpecError> {
        spec.validate()?;
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        if inner.ids.get(&spec.name).is_some_and(|id| inner.live.contains_key(id)) {
            return Err(SpecError::Duplicate(spec.name));
        }
        // (A replica without an HTTP address is followed for its events alone.)
        let server = server_of(&spec.http_url);
        if !server.is_empty()
            && let Some(other) = inner.live.values().find(|r| server_of(&r.spec.http_url) == server)
        {
            let (other, url) = (other.spec.name.clone(), other.spec.http_url.clone());
            return Err(SpecError::SameServer { name: spec.name, other, url });
        }
        let ours: Vec<_> = event_streams(&spec.event_endpoint, spec.dp_size, &spec.topic).collect();
        for other in inner.live.values() {
            let theirs = &other.spec;
            if let Some((endpoint, _)) = event_streams(&theirs.event_endpoint, theirs.dp_size, &theirs.topic)
                .find(|theirs| ours.iter().any(|ours| one_stream(ours, theirs)))
            {
                let (other, topics) = (theirs.name.clone(), (spec.topic.clone(), theirs.topic.clone()));
                return Err(SpecError::SameStream { name: spec.name, other, endpoint, topics });
            }
        }
        // Named only once it is in: a name refused is none the fleet knows (a drain kept for
        // it would wait for a replica never added).
        let next = ReplicaId(u32::try_from(inner.ids.len()).expect("fewer than 2^32 replica names"));
        let id = *inner.ids.entry(spec.name.clone()).or_insert(next);
        let origin = spec
            .http_url
            .parse::<http::Uri>()
            .ok()
            .filter(|url| url.path_and_query().is_none_or(|pq| matches!(pq.as_str(), "" | "/")))
            .map(http::Uri::into_parts)
            .and_then(|parts| Some((parts.scheme?, parts.authority?)))
            .filter(|(scheme, _)| matches!(scheme.as_str(), "http" | "https"));
        let status = ReplicaStatus::new(spec.dp_size);
        let replica = Arc::new(Replica {
            id,
            tie: xxhash_rust::xxh3::xxh3_64(spec.name.as_bytes()),
            status,
            spec,
            origin,
            ranks: Default::default(),
            prediction: Default::default(),
        });
        inner.live.insert(id, replica.clone());
        Ok(replica)
    }

    /// Unregisters a replica; returns it if it was registered.
    pub fn remove(&self, id: ReplicaId) -> Option<Arc<Replica>> {
        self.inner.write().unwrap_or_else(PoisonError::into_inner).live.remove(&id)
    }

    pub fn get(&self, id: ReplicaId) -> Option<Arc<Replica>> {
        self.inner.read().unwrap_or_else(PoisonError::into_inner).live.get(&id).cloned()
    }

    /// Whether a replica called `name` has ever been registered.
    pub fn knows(&self, name: &str) -> bool {
        self.inner.read().unwrap_or_else(PoisonError::into_inner).ids.contains_key(name)
    }

    /// The registered replica called `name`, if any.
    pub fn by_name(&self, name: &str) -> Option<Arc<Replica>> {
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        inner.ids.get(name).and_then(|id| inner.live.get(id)).cloned()
    }

    /// Every registered replica, ordered by id.
    pub fn list(&self) -> Vec<Arc<Replica>> {
        let mut all: Vec<_> =
            self.inner.read().unwrap_or_else(PoisonError::into_inner).live.values().cloned().collect();
        all.sort_by_key(|r| r.id);
        all
    }

    /// True once every registered replica completed its first sync.
    pub fn all_synced(&self) -> bool {
        self.list().iter().all(|r| r.status.is_synced())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's `max_cache_hit_length = num_tokens - 1`, in whole blocks of 16.
    #[test]
    fn real_engines_recompute_an_all_cached_last_block() {
        for engine in [EngineKind::Vllm, EngineKind::Sglang] {
            let reusable = |len| engine.reusable_blocks(len, 16);
            assert_eq!(
                [reusable(0), reusable(1), reusable(16), reusable(17), reusable(32), reusable(33)],
                [0, 0, 0, 1, 1, 2]
            );
            assert_eq!(engine.reusable_blocks(100, 0), 0, "no block size, no blocks");
        }
        assert_eq!(
            EngineKind::Kvroute.reusable_blocks(32, 16),
            usize::MAX,
            "the agent reuses every full block"
        );
    }

    /// vLLM with EAGLE or MTP drops a hit's last block (`drop_eagle_block`); without, or on
    /// the other engines, a hit is what is held, within what the prompt can reuse.
    #[test]
    fn eagle_drops_the_last_block_of_a_vllm_hit() {
        assert_eq!(EngineKind::Vllm.reused_blocks(3, 100, 16, true), 2);
        assert_eq!(EngineKind::Vllm.reused_blocks(10, 100, 16, true), 5, "6 reusable, one dropped");
        assert_eq!(EngineKind::Vllm.reused_blocks(0, 100, 16, true), 0);
        assert_eq!(EngineKind::Vllm.reused_blocks(3, 100, 16, false), 3);
        assert_eq!(EngineKind::Sglang.reused_blocks(3, 100, 16, true), 3);
        assert_eq!(EngineKind::Kvroute.reused_blocks(3, 100, 16, true), 3);
    }

    #[test]
    fn dp_size_is_bounded() {
        let mut spec = ReplicaSpec::new("a", "ipc:///tmp/x", EngineKind::Vllm, "m");
        spec.dp_size = MAX_DP_SIZE;
        assert_eq!(spec.validate(), Ok(()));
        spec.dp_size = u32::MAX;
        assert_eq!(spec.validate(), Err(SpecError::TooManyRanks(u32::MAX)));
    }

    /// Regression: events on 5557 and replay on 5558 were accepted for two ranks, whose rank 1
    /// publishes its events on rank 0's replay port (both are offset by the rank).
    #[test]
    fn ranks_whose_event_and_replay_ports_meet_are_refused() {
        let spec = |events: &str, replay: &str, dp_size| ReplicaSpec {
            replay_endpoint: Some(replay.into()),
            dp_size,
            ..ReplicaSpec::new("a", events, EngineKind::Vllm, "m")
        };
        assert_eq!(spec("tcp://h:5557", "tcp://h:5558", 1).validate(), Ok(()));
        assert_eq!(spec("tcp://h:5557", "tcp://h:5600", 8).validate(), Ok(()));
        assert_eq!(spec("tcp://h:5557", "tcp://g:5558", 2).validate(), Ok(()), "another host");
        assert_eq!(spec("ipc:///tmp/e", "ipc:///tmp/r", 2).validate(), Ok(()));
        for (events, replay, dp_size, shared) in [
            ("tcp://h:5557", "tcp://h:5558", 2, "tcp://h:5558"),
            ("tcp://h:5600", "tcp://h:5557", 64, "tcp://h:5600"),
            ("tcp://h:5557", "tcp://h:5557", 1, "tcp://h:5557"),
        ] {
            let want = SpecError::RanksOverlap { shared: shared.into(), dp_size };
            assert_eq!(spec(events, replay, dp_size).validate(), Err(want), "{events} {replay} {dp_size}");
        }
    }

    #[test]
    fn rank_endpoints_follow_vllm() {
        assert_eq!(rank_endpoint("tcp://h:5557", 0).unwrap(), "tcp://h:5557");
        assert_eq!(rank_endpoint("tcp://h:5557", 3).unwrap(), "tcp://h:5560");
        assert_eq!(rank_endpoint("tcp://[::1]:5557", 1).unwrap(), "tcp://[::1]:5558");
        assert_eq!(rank_endpoint("tcp://h:0", 2).unwrap(), "tcp://h:0");
        assert_eq!(rank_endpoint("ipc:///tmp/kv", 1).unwrap(), "ipc:///tmp/kv_dp1");
        assert!(rank_endpoint("tcp://h:65535", 1).is_err());
        // vLLM's bind address, which no one can connect to.
        assert_eq!(rank_endpoint("tcp://*:5557", 0), Err(SpecError::BindAddress("tcp://*:5557".into())));
        assert!(rank_endpoint("tcp://:5557", 0).is_err());
        assert!(rank_endpoint("tcp://h", 0).is_err());
        assert!(rank_endpoint("http://h:1", 0).is_err());
    }

    #[test]
    fn base_urls_are_http_or_https_with_a_host() {
        assert_eq!(base_url("http://10.0.0.7:8000/").unwrap(), "http://10.0.0.7:8000");
        assert_eq!(base_url("https://replica-0.example:8443/").unwrap(), "https://replica-0.example:8443");
        assert_eq!(base_url("https://[fd00::7]:8443").unwrap(), "https://[fd00::7]:8443");
        assert_eq!(base_url("http://[fd00::7]:8000").unwrap(), "http://[fd00::7]:8000");
        assert_eq!(base_url("http://gw:80/replica-0/").unwrap(), "http://gw:80/replica-0");
        assert_eq!(base_url("http://u@h:8000").unwrap(), "http://u@h:8000");
        for bad in [
            "",
            "http://",
            "ftp://h:1",
            "https://label-.example:1",
            "h:8000",
            "http://h:8000 ",
            "http://h:99999",
            "http://0:70000",
            "http://h:",
            "http://h:1/?a=b",
            "http://h:1/p#x",
        ] {
            assert!(matches!(base_url(bad), Err(SpecError::Url(..))), "{bad:?}");
        }
        let mut spec = ReplicaSpec::new("a", "tcp://h:1", EngineKind::Kvroute, "m");
        spec.grpc_endpoint = Some("h:50051".into());
        assert!(matches!(spec.validate(), Err(SpecError::Url(..))));
        spec.grpc_endpoint = Some("http://gw:80/agent-0".into());
        assert!(matches!(spec.validate(), Err(SpecError::Url(..))), "a path, which tonic drops");
        spec.grpc_endpoint = Some("https://h:50051".into());
        assert!(matches!(spec.validate(), Err(SpecError::Url(..))), "gRPC without TLS");
        spec.grpc_endpoint = Some("HTTP://h:50051".into());
        assert!(spec.validate().is_ok(), "the scheme in capitals");
        for fine in ["http://h:50051", "http://h:50051/"] {
            spec.grpc_endpoint = Some(fine.into());
            assert_eq!(spec.validate(), Ok(()), "{fine}");
        }
    }

    #[test]
    fn names_intern_to_stable_ids() {
        let replicas = Replicas::new();
        let a = replicas.insert(ReplicaSpec::new("a", "tcp://h:1", EngineKind::Vllm, "m")).unwrap();
        let b = replicas.insert(ReplicaSpec::new("b", "tcp://h:2", EngineKind::Vllm, "m")).unwrap();
        assert_ne!(a.id, b.id);
        assert_eq!(
            replicas.insert(ReplicaSpec::new("a", "tcp://h:1", EngineKind::Vllm, "m")).unwrap_err(),
            SpecError::Duplicate("a".into())
        );
        replicas.remove(a.id).unwrap();
        assert!(replicas.by_name("a").is_none());
        let again = replicas.insert(ReplicaSpec::new("a", "tcp://h:1", EngineKind::Vllm, "m")).unwrap();
        assert_eq!(again.id, a.id);
        assert_eq!(replicas.list().len(), 2);
        // One server, two names: refused while the first is there.
        let at = |name: &str, url: &str| ReplicaSpec {
            http_url: url.into(),
            ..ReplicaSpec::new(name, "tcp://h:0", EngineKind::Vllm, "m")
        };
        let c = replicas.insert(at("c", "http://h:8000")).unwrap();
        assert_eq!(
            replicas.insert(at("d", "http://h:8000/")).unwrap_err(),
            SpecError::SameServer { name: "d".into(), other: "c".into(), url: "http://h:8000".into() }
        );
        assert!(!replicas.knows("d"), "a name refused is not one the fleet knows");
        // Spelled another way, it is still the one server; another port is another server.
        assert!(matches!(replicas.insert(at("d", "HTTP://H:8000")), Err(SpecError::SameServer { .. })));
        let e = replicas.insert(at("e", "http://h")).unwrap();
        assert!(matches!(replicas.insert(at("d", "http://h:80/")), Err(SpecError::SameServer { .. })));
        replicas.remove(e.id).unwrap();
        replicas.remove(c.id).unwrap();
        replicas.insert(at("d", "http://h:8000")).unwrap();
    }

    /// An event stream (a rank's endpoint and topic) is one replica's, however it is reached:
    /// the first rank of one, or a later rank of another; a topic that neither begins nor is
    /// begun by another's is another stream.
    #[test]
    fn one_event_stream_is_one_replicas() {
        let replicas = Replicas::new();
        let on = |name: &str, events: &str, dp_size: u32, topic: &str| ReplicaSpec {
            dp_size,
            topic: topic.into(),
            ..ReplicaSpec::new(name, events, EngineKind::Vllm, "m")
        };
        let a = replicas.insert(on("a", "tcp://h:5557", 2, "")).unwrap();
        assert_eq!(
            replicas.insert(on("b", "tcp://h:5558", 1, "")).unwrap_err(),
            SpecError::SameStream {
                name: "b".into(),
                other: "a".into(),
                endpoint: "tcp://h:5558".into(),
                topics: Default::default()
            }
        );
        assert!(matches!(replicas.insert(on("b", "tcp://h:5556", 2, "")), Err(SpecError::SameStream { .. })));
        assert!(!replicas.knows("b"), "a name refused is not one the fleet knows");
        // The empty topic takes every topic, and a topic every topic it begins.
        assert!(matches!(
            replicas.insert(on("b", "tcp://h:5558", 1, "kv@b")),
            Err(SpecError::SameStream { .. })
        ));
        replicas.insert(on("b", "tcp://h:5560", 1, "kv@b")).unwrap();
        let prefix = replicas.insert(on("c", "tcp://h:5560", 1, "kv")).unwrap_err().to_string();
        assert!(prefix.contains(r#"tcp://h:5560, topics "kv" and "kv@b""#), "{prefix}");
        replicas.insert(on("c", "tcp://h:5560", 1, "kv@c")).unwrap();
        replicas.insert(on("g", "tcp://h:5559", 1, "")).unwrap();
        // A host is one whatever its case.
        assert!(matches!(replicas.insert(on("j", "tcp://H:5559", 1, "")), Err(SpecError::SameStream { .. })));
        replicas.insert(on("j", "ipc:///tmp/K", 1, "")).unwrap();
        replicas.insert(on("k", "ipc:///tmp/k", 1, "")).unwrap();
        // Port 0 is never connected to, so it is no one's stream.
        replicas.insert(on("d", "tcp://h:0", 1, "")).unwrap();
        replicas.insert(on("e", "tcp://h:0", 1, "")).unwrap();
        replicas.remove(a.id).unwrap();
        replicas.insert(on("f", "tcp://h:5557", 1, "")).unwrap();
    }

    #[test]
    fn state_is_the_worst_rank_and_sync_needs_every_rank() {
        let status = ReplicaStatus::new(2);
        assert_eq!(status.state(), StreamState::Degraded);
        status.set_rank_state(0, StreamState::Exact);
        assert_eq!(status.state(), StreamState::Degraded);
        status.set_rank_state(1, StreamState::Exact);
        assert_eq!(status.state(), StreamState::Exact);
        status.set_rank_state(1, StreamState::Fallback);
        assert_eq!(status.state(), StreamState::Fallback);
        status.mark_rank_synced(0);
        assert!(!status.is_synced());
        status.mark_rank_synced(1);
        assert!(status.is_synced());
    }
}
