//! Replica discovery: keeps the router's replica set equal to what the platform says is
//! running, as an alternative (or an addition) to the static `--replica` list.
//!
//! Two sources, chosen by `--discovery` ([`DiscoveryConfig`]):
//! - **dns** (`dns`): resolves a headless Service's name every `--discovery-interval-ms`
//!   (5 s); every address is a replica named by its IP, with the configured ports. A failed
//!   resolution (a timeout, SERVFAIL) keeps the current set (a resolver hiccup must not empty
//!   the fleet; the proxy's health checks eject replicas that are really gone). An address
//!   joins as soon as it is answered and leaves once six answers in a row (30 s at the
//!   default interval) have left it out: a Service leaves out pods that are not Ready, as in
//!   an overload where readiness probes fail, and a name with no Ready pod at all has no
//!   address (NXDOMAIN, NODATA: an empty answer).
//! - **Kubernetes** (`k8s`, cargo feature `k8s`): watches the EndpointSlices labelled
//!   `kubernetes.io/service-name=<service>` with kube's watcher (list, then watch from the
//!   list's resourceVersion; a dropped watch resumes from the last seen version, a `410 Gone`
//!   re-lists). Every endpoint that is not terminating is a replica named after its pod
//!   (`targetRef`, else its address); its ports come from the pod's `kvroute.io/*`
//!   annotations (opt-in, `k8s::PodOverrides`), else the slice's named ports (`http`,
//!   `kv-events`, `kv-replay`, `grpc` by default), else the configured numbers (an events
//!   port of 0: the replica publishes none, and its cache is predicted). An endpoint
//!   that is not Ready (or not serving) is followed but not routed to: a readiness probe
//!   that times out under load must not throw away what the index knows of the replica's
//!   cache (vLLM has no snapshot, and its replay buffer holds only recent batches). An
//!   endpoint that is terminating, leaves its slice, or whose slice is deleted is removed.
//!
//! Both feed a [`Reconciler`]: the desired set (name → [`ReplicaSpec`] and whether it is
//! serving) is diffed against what was last applied, and only the differences reach the
//! [`ReplicaSink`] (removals first, then name by name a change of serving before an addition
//! or a changed spec), one at a time and awaited, so a sink never sees two operations on one
//! name at once. A spec the sink refuses is tried once more after the rest of the listing
//! (an address it wants may be freed later in it), then left to the next listing. Removing
//! a replica frees everything it held in the
//! index (the sink calls [`Ingest::remove_replica`]).
//!
//! [`Discovery::is_listed`] turns true after the first complete listing, for `/ready`.

pub mod config;
mod dns;
#[cfg(feature = "k8s")]
pub mod k8s;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::{DiscoveryConfig, DiscoveryMode, PortNames};

use crate::ingest::{Ingest, IngestError};
use crate::replicas::{EngineKind, ReplicaSpec};

/// Where discovered replicas go: the seam between discovery and the router's fleet (which
/// adds them to ingestion and to the proxy's upstreams).
pub trait ReplicaSink: Send + Sync + 'static {
    /// Why a spec was refused (logged and counted by discovery, which goes on).
    type Error: std::error::Error + Send + Sync + 'static;

    /// Adds a replica, or replaces the registered one of the same name whose spec changed
    /// (e.g. a pod that came back with a new IP).
    fn upsert(&self, spec: ReplicaSpec) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Removes a replica and frees what it held (index entries, streams, metrics).
    fn remove(&self, name: &str) -> impl Future<Output = ()> + Send;

    /// Whether the platform says the replica named `name` serves (Kubernetes: its endpoint is
    /// Ready). A replica that does not is kept, its events followed, but not routed to. The
    /// sink keeps this by name: discovery says it before adding a replica that does not
    /// serve, and a replica added under the name later (an update, an admin's re-add) starts
    /// that way, until the name serves again or discovery removes it.
    fn set_serving(&self, name: &str, serving: bool) {
        let _ = (name, serving);
    }

    /// Whether the replica registered under `name` is the one `spec` describes: after an
    /// update it refused, discovery removes what it had added, but not a replica an admin
    /// added under the name meanwhile (between the update's removal and its add).
    fn holds(&self, name: &str, spec: &ReplicaSpec) -> bool {
        let _ = (name, spec);
        true
    }
}

/// Ingestion alone as a sink (the fleet wraps it to also update the proxy's upstreams).
impl ReplicaSink for Ingest {
    type Error = IngestError;

    async fn upsert(&self, spec: ReplicaSpec) -> Result<(), IngestError> {
        if let Some(existing) = self.replicas().by_name(&spec.name) {
            if existing.spec == spec {
                return Ok(());
            }
            self.remove_replica(existing.id).await;
        }
        self.add_replica(spec).map(drop)
    }

    async fn remove(&self, name: &str) {
        if let Some(existing) = self.replicas().by_name(name) {
            self.remove_replica(existing.id).await;
        }
    }

    fn holds(&self, name: &str, spec: &ReplicaSpec) -> bool {
        self.replicas().by_name(name).is_some_and(|r| r.spec == *spec)
    }
}

/// A replica's port numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ports {
    pub http: u16,
    /// ZeroMQ PUB port of rank 0.
    pub events: u16,
    pub replay: Option<u16>,
    pub grpc: Option<u16>,
}

/// What every discovered replica shares; discovery fills in the name and the address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaTemplate {
    pub engine: EngineKind,
    pub dp_size: u32,
    pub topic: String,
    pub model: String,
    pub block_size: Option<u32>,
    /// Default ports (DNS mode; fallbacks for ports a slice does not name).
    pub ports: Ports,
    /// The OpenAI API is reached over HTTPS (`--discovery-https`).
    pub https: bool,
}

impl ReplicaTemplate {
    /// The spec of replica `name` at `host` (an IP address or a DNS name).
    pub fn spec(&self, name: String, host: &str, ports: Ports) -> ReplicaSpec {
        let host = if host.contains(':') { format!("[{host}]") } else { host.to_owned() };
        // Events on port 0: none, the replica's cache is predicted.
        let events = match ports.events {
            0 => String::new(),
            port => format!("tcp://{host}:{port}"),
        };
        let mut spec = ReplicaSpec::new(name, events, self.engine, self.model.clone());
        let scheme = if self.https { "https" } else { "http" };
        spec.http_url = format!("{scheme}://{host}:{}", ports.http);
        spec.replay_endpoint = ports.replay.map(|p| format!("tcp://{host}:{p}"));
        spec.grpc_endpoint = ports.grpc.map(|p| format!("http://{host}:{p}"));
        spec.dp_size = self.dp_size;
        spec.topic = self.topic.clone();
        spec.block_size = self.block_size;
        spec
    }
}

/// Why discovery could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("--discovery-service is required with --discovery dns|k8s")]
    NoService,
    #[error("--discovery k8s needs a router built with the `k8s` feature")]
    K8sDisabled,
    #[cfg(feature = "k8s")]
    #[error("cannot set up the Kubernetes client")]
    Kube(#[source] kube::Error),
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

/// Discovery's metrics (prefix `kvroute_discovery_`).
#[derive(Clone, Debug, Default)]
pub struct DiscoveryMetrics {
    replicas: Gauge,
    changes: Family<OpLabel, Counter>,
    errors: Counter,
}

impl DiscoveryMetrics {
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("kvroute_discovery");
        r.register("replicas", "Replicas discovery currently lists", m.replicas.clone());
        r.register(
            "changes",
            "Replica additions, updates, removals and changes of serving applied (op: added, updated, removed, serving, not_serving)",
            m.changes.clone(),
        );
        r.register(
            "errors",
            "Failed resolutions, watch errors and refused specs (discovery retries)",
            m.errors.clone(),
        );
        m
    }

    fn change(&self, op: &'static str) {
        self.changes.get_or_create(&OpLabel { op }).inc();
    }
}

/// Applies desired replica sets to a sink, sending only the differences.
#[derive(Debug)]
pub struct Reconciler<S> {
    sink: S,
    metrics: DiscoveryMetrics,
    applied: BTreeMap<String, ReplicaSpec>,
    /// Applied replicas the sink was told are not serving.
    not_serving: BTreeSet<String>,
    listed: watch::Sender<bool>,
}

impl<S: ReplicaSink> Reconciler<S> {
    pub fn new(sink: S, metrics: DiscoveryMetrics) -> Self {
        Self {
            sink,
            metrics,
            applied: BTreeMap::new(),
            not_serving: BTreeSet::new(),
            listed: watch::Sender::new(false),
        }
    }

    /// Makes the sink hold exactly `desired`, every replica serving (as far as the sink
    /// accepts the specs), and marks the first listing done.
    pub async fn apply(&mut self, desired: BTreeMap<String, ReplicaSpec>) {
        self.apply_serving(desired.into_iter().map(|(name, spec)| (name, (spec, true))).collect()).await;
    }

    /// [`Self::apply`] with each replica's spec and whether it is serving.
    pub async fn apply_serving(&mut self, desired: BTreeMap<String, (ReplicaSpec, bool)>) {
        let gone: Vec<String> = self.applied.keys().filter(|n| !desired.contains_key(*n)).cloned().collect();
        for name in gone {
            tracing::info!(replica = %name, "discovery: replica gone");
            self.sink.remove(&name).await;
            self.applied.remove(&name);
            self.not_serving.remove(&name);
            self.metrics.change("removed");
        }
        // A spec refused is tried once more after the rest of the listing: the address it
        // wants may be freed by a replica later in it (a pod IP handed to another pod while
        // the first one moved).
        let mut refused = Vec::new();
        for (name, (spec, serving)) in desired {
            if let Some(again) = self.apply_one(name, spec, serving, false).await {
                refused.push(again);
            }
        }
        for (name, spec, serving) in refused {
            self.apply_one(name, spec, serving, true).await;
        }
        self.metrics.replicas.set(i64::try_from(self.applied.len()).unwrap_or(i64::MAX));
        self.listed.send_if_modified(|l| !std::mem::replace(l, true));
    }

    /// Makes the sink hold `spec` under `name`. A refused spec is handed back, unless this
    /// is its `last` try, which logs, counts and clears what the name held.
    async fn apply_one(
        &mut self,
        name: String,
        spec: ReplicaSpec,
        serving: bool,
        last: bool,
    ) -> Option<(String, ReplicaSpec, bool)> {
        let op = match self.applied.get(&name) {
            Some(old) if *old == spec => None,
            Some(_) => Some("updated"),
            None => Some("added"),
        };
        let changes_serving = serving == self.not_serving.contains(&name);
        let Some(op) = op else {
            if changes_serving {
                self.set_serving(&name, serving);
            }
            return None;
        };
        // "Not serving" before the spec and "serving" after it: the sink keeps it by name
        // and applies it to a replica it adds, so neither the new replica nor the old one
        // it replaces is routable while its pod is not Ready, not even between the calls.
        if changes_serving && !serving {
            self.set_serving(&name, false);
        }
        tracing::info!(replica = %name, http = %spec.http_url, events = %spec.event_endpoint, "discovery: replica {op}");
        match self.sink.upsert(spec.clone()).await {
            Ok(()) => {
                self.metrics.change(op);
                if changes_serving && serving {
                    self.set_serving(&name, true);
                }
                self.applied.insert(name, spec);
            }
            Err(_) if !last => return Some((name, spec, serving)),
            Err(e) => {
                // Not recorded as applied: the next listing tries again.
                tracing::warn!(replica = %name, error = %e, "discovery: replica refused");
                self.metrics.errors.inc();
                if let Some(old) = self.applied.remove(&name)
                    && self.sink.holds(&name, &old)
                {
                    self.sink.remove(&name).await;
                }
                // Nothing of the name is left, not even its serving (said again next time):
                // forgotten quietly, it was never a change of the replica's.
                if self.not_serving.remove(&name) {
                    self.sink.set_serving(&name, true);
                }
            }
        }
        None
    }

    /// Tells the sink whether `name` serves, and remembers it.
    fn set_serving(&mut self, name: &str, serving: bool) {
        tracing::info!(replica = %name, serving, "discovery: replica {}", if serving { "serving" } else { "not serving" });
        self.sink.set_serving(name, serving);
        if serving {
            self.not_serving.remove(name);
        } else {
            self.not_serving.insert(name.to_owned());
        }
        self.metrics.change(if serving { "serving" } else { "not_serving" });
    }

    /// Counts a source error (a failed resolution or watch step).
    pub fn error(&self, error: &dyn std::error::Error) {
        tracing::warn!(error = %error, "discovery error; retrying");
        self.metrics.errors.inc();
    }

    /// [`Self::error`] of one said already (the same step failing again): counted, logged
    /// at debug level only.
    pub fn error_again(&self, error: &dyn std::error::Error) {
        tracing::debug!(error = %error, "discovery error again; retrying");
        self.metrics.errors.inc();
    }

    /// The names currently applied.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.applied.keys().map(String::as_str)
    }

    fn listed(&self) -> watch::Receiver<bool> {
        self.listed.subscribe()
    }
}

/// A running discovery source: tells whether the first listing completed.
#[derive(Clone, Debug)]
pub struct Discovery {
    listed: watch::Receiver<bool>,
}

impl Discovery {
    /// Starts the source `config` selects on `tracker`; it stops when `shutdown` fires
    /// (leaving the replicas in place: the router is going away). Static mode starts
    /// nothing and counts as listed.
    pub async fn start<S: ReplicaSink>(
        config: &DiscoveryConfig,
        template: ReplicaTemplate,
        sink: S,
        metrics: DiscoveryMetrics,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<Self, DiscoveryError> {
        let service = config.discovery_service.clone().filter(|s| !s.is_empty());
        match config.discovery {
            DiscoveryMode::Static => Ok(Self { listed: watch::Sender::new(true).subscribe() }),
            DiscoveryMode::Dns => {
                let host = service.ok_or(DiscoveryError::NoService)?;
                let reconciler = Reconciler::new(sink, metrics);
                let listed = reconciler.listed();
                let source = dns::DnsSource { host, template, interval: config.interval() };
                tracker.spawn(source.run(dns::system_resolver, reconciler, shutdown));
                Ok(Self { listed })
            }
            #[cfg(feature = "k8s")]
            DiscoveryMode::K8s => {
                service.as_ref().ok_or(DiscoveryError::NoService)?;
                let client = kube::Client::try_default().await.map_err(DiscoveryError::Kube)?;
                Self::start_k8s(client, config, template, sink, metrics, tracker, shutdown)
            }
            #[cfg(not(feature = "k8s"))]
            DiscoveryMode::K8s => Err(DiscoveryError::K8sDisabled),
        }
    }

    /// Kubernetes discovery with a given client (tests point it at a fake API server).
    #[cfg(feature = "k8s")]
    pub fn start_k8s<S: ReplicaSink>(
        client: kube::Client,
        config: &DiscoveryConfig,
        template: ReplicaTemplate,
        sink: S,
        metrics: DiscoveryMetrics,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<Self, DiscoveryError> {
        let service =
            config.discovery_service.clone().filter(|s| !s.is_empty()).ok_or(DiscoveryError::NoService)?;
        let namespace =
            config.discovery_namespace.clone().unwrap_or_else(|| client.default_namespace().to_owned());
        let reconciler = Reconciler::new(sink, metrics);
        let listed = reconciler.listed();
        let source = k8s::SliceSource { service, template, port_names: config.port_names() };
        let pods =
            config.discovery_pod_annotations.then(|| kube::Api::namespaced(client.clone(), &namespace));
        let (slices, retry) = (kube::Api::namespaced(client, &namespace), config.interval());
        tracker.spawn(source.run(slices, pods, reconciler, retry, shutdown));
        Ok(Self { listed })
    }

    /// True once the source completed its first listing.
    pub fn is_listed(&self) -> bool {
        *self.listed.borrow()
    }

    /// Waits for the first complete listing.
    pub async fn wait_listed(&self) {
        let mut rx = self.listed.clone();
        // The sender lives in the source task; if it ended (shutdown), stop waiting.
        if rx.wait_for(|l| *l).await.is_err() {
            tracing::debug!("discovery stopped before its first listing");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// Records every call; refuses names starting with `bad` and the address 10.0.0.66; holds
    /// someone else's replica under the names in its second list.
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<String>>>, Arc<Mutex<Vec<String>>>);

    #[derive(Debug, thiserror::Error)]
    #[error("refused")]
    struct Refused;

    impl ReplicaSink for Log {
        type Error = Refused;
        async fn upsert(&self, spec: ReplicaSpec) -> Result<(), Refused> {
            self.0.lock().unwrap().push(format!("+{}@{}", spec.name, spec.http_url));
            if spec.name.starts_with("bad") || spec.http_url.contains("10.0.0.66") {
                Err(Refused)
            } else {
                Ok(())
            }
        }
        fn holds(&self, name: &str, _: &ReplicaSpec) -> bool {
            !self.1.lock().unwrap().iter().any(|n| n == name)
        }
        async fn remove(&self, name: &str) {
            self.0.lock().unwrap().push(format!("-{name}"));
        }
        fn set_serving(&self, name: &str, serving: bool) {
            self.0
                .lock()
                .unwrap()
                .push(format!("{}{name}", if serving { "serving " } else { "not serving " }));
        }
    }

    fn template() -> ReplicaTemplate {
        ReplicaTemplate {
            engine: EngineKind::Vllm,
            dp_size: 2,
            topic: "kv".into(),
            model: "m".into(),
            block_size: Some(16),
            ports: Ports { http: 8000, events: 5557, replay: Some(5600), grpc: None },
            https: false,
        }
    }

    fn set(entries: &[(&str, &str)]) -> BTreeMap<String, ReplicaSpec> {
        let t = template();
        entries.iter().map(|(n, ip)| (n.to_string(), t.spec(n.to_string(), ip, t.ports))).collect()
    }

    #[test]
    fn template_builds_endpoints() {
        let t = template();
        let spec = t.spec("r".into(), "10.0.0.7", t.ports);
        assert_eq!(spec.http_url, "http://10.0.0.7:8000");
        assert_eq!(spec.event_endpoint, "tcp://10.0.0.7:5557");
        assert_eq!(spec.replay_endpoint.as_deref(), Some("tcp://10.0.0.7:5600"));
        assert_eq!(spec.grpc_endpoint, None);
        assert_eq!((spec.engine, spec.dp_size, spec.topic.as_str()), (EngineKind::Vllm, 2, "kv"));
        spec.validate().unwrap();
        let v6 = t.spec("r".into(), "fd00::7", Ports { grpc: Some(50051), ..t.ports });
        assert_eq!(v6.event_endpoint, "tcp://[fd00::7]:5557");
        assert_eq!(v6.grpc_endpoint.as_deref(), Some("http://[fd00::7]:50051"));
        v6.validate().unwrap();
        let t = ReplicaTemplate { dp_size: 1, topic: String::new(), ..t };
        let predicted = t.spec("r".into(), "10.0.0.7", Ports { events: 0, replay: None, ..t.ports });
        assert!(!predicted.has_events(), "{predicted:?}");
        predicted.validate().unwrap();
        let https = ReplicaTemplate { https: true, ..t };
        let spec = https.spec("r".into(), "10.0.0.7", Ports { grpc: Some(50051), ..https.ports });
        assert_eq!(
            (spec.http_url.as_str(), spec.grpc_endpoint.as_deref()),
            ("https://10.0.0.7:8000", Some("http://10.0.0.7:50051"))
        );
        spec.validate().unwrap();
    }

    #[tokio::test]
    async fn reconciler_sends_only_differences() {
        let log = Log::default();
        let mut r = Reconciler::new(log.clone(), DiscoveryMetrics::default());
        let listed = r.listed();
        assert!(!*listed.borrow());
        r.apply(set(&[("a", "10.0.0.1"), ("b", "10.0.0.2")])).await;
        assert!(*listed.borrow());
        r.apply(set(&[("a", "10.0.0.1"), ("b", "10.0.0.2")])).await;
        r.apply(set(&[("a", "10.0.0.9"), ("c", "10.0.0.3")])).await;
        assert_eq!(
            *log.0.lock().unwrap(),
            [
                "+a@http://10.0.0.1:8000",
                "+b@http://10.0.0.2:8000",
                "-b",
                "+a@http://10.0.0.9:8000",
                "+c@http://10.0.0.3:8000"
            ]
        );
        assert_eq!(r.names().collect::<Vec<_>>(), ["a", "c"]);
    }

    #[tokio::test]
    async fn refused_specs_are_retried_and_not_kept() {
        let log = Log::default();
        let mut r = Reconciler::new(log.clone(), DiscoveryMetrics::default());
        r.apply(set(&[("bad", "10.0.0.1")])).await;
        r.apply(set(&[("bad", "10.0.0.1")])).await;
        assert_eq!(r.names().count(), 0);
        assert_eq!(r.metrics.errors.get(), 2, "a refusal counts once, after its second try");
        assert_eq!(*log.0.lock().unwrap(), ["+bad@http://10.0.0.1:8000"; 4]);
    }

    /// A pod's address handed to another pod while the first moved, within one listing: the
    /// one listed first is refused until the other has moved, and is added then (before, it
    /// waited for the next listing, counted as an error).
    #[tokio::test]
    async fn an_address_freed_later_in_a_listing_is_taken_in_it() {
        let shutdown = tokio_util::sync::CancellationToken::new();
        let ingest = crate::ingest::Ingest::start(
            Default::default(),
            crate::index::SharedIndex::new(),
            &mut Default::default(),
            tokio_util::task::TaskTracker::new(),
            shutdown.clone(),
        );
        let mut r = Reconciler::new(ingest.clone(), DiscoveryMetrics::default());
        r.apply(set(&[("b", "127.0.0.2")])).await;
        r.apply(set(&[("a", "127.0.0.2"), ("b", "127.0.0.3")])).await;
        assert_eq!(r.metrics.errors.get(), 0);
        assert_eq!(r.names().collect::<Vec<_>>(), ["a", "b"]);
        let url = |name| ingest.replicas().by_name(name).map(|r| r.spec.http_url.clone());
        assert_eq!(url("a").as_deref(), Some("http://127.0.0.2:8000"));
        assert_eq!(url("b").as_deref(), Some("http://127.0.0.3:8000"));
        shutdown.cancel();
    }

    /// An update the sink refuses removes the replica discovery had added, but not one that
    /// another (an admin) added under the name meanwhile.
    #[tokio::test]
    async fn a_refused_update_removes_only_discoverys_own_replica() {
        for foreign in [false, true] {
            let log = Log::default();
            let mut r = Reconciler::new(log.clone(), DiscoveryMetrics::default());
            r.apply(set(&[("a", "10.0.0.1")])).await;
            if foreign {
                log.1.lock().unwrap().push("a".into());
            }
            r.apply(set(&[("a", "10.0.0.66")])).await;
            let removed = log.0.lock().unwrap().iter().any(|call| call == "-a");
            assert_eq!(removed, !foreign, "foreign: {foreign}: {:?}", log.0.lock().unwrap());
            assert_eq!(r.names().count(), 0, "not applied either way: tried again next time");
        }
    }

    /// A replica that stops serving is kept (its index survives) and told so; it is told
    /// again when it serves again; one added or replaced while not serving is told first, so
    /// the sink adds it not serving.
    #[tokio::test]
    async fn serving_changes_keep_the_replica() {
        let log = Log::default();
        let mut r = Reconciler::new(log.clone(), DiscoveryMetrics::default());
        let serving = |entries: &[(&str, &str, bool)]| {
            let t = template();
            entries
                .iter()
                .map(|(n, ip, s)| (n.to_string(), (t.spec(n.to_string(), ip, t.ports), *s)))
                .collect()
        };
        r.apply_serving(serving(&[("a", "10.0.0.1", true), ("b", "10.0.0.2", false)])).await;
        r.apply_serving(serving(&[("a", "10.0.0.1", false), ("b", "10.0.0.2", false)])).await;
        r.apply_serving(serving(&[("a", "10.0.0.1", true), ("b", "10.0.0.22", false)])).await;
        r.apply_serving(serving(&[("a", "10.0.0.1", true), ("b", "10.0.0.22", true)])).await;
        assert_eq!(
            *log.0.lock().unwrap(),
            [
                "+a@http://10.0.0.1:8000",
                "not serving b",
                "+b@http://10.0.0.2:8000",
                "not serving a",
                "serving a",
                "+b@http://10.0.0.22:8000",
                "serving b",
            ]
        );
    }

    /// A replica back to serving under a changed spec is told so only once the sink has the
    /// new spec (the old, not Ready address is never routable); a refused spec that was not
    /// serving is forgotten without a word.
    #[tokio::test]
    async fn serving_is_said_after_a_new_spec_and_a_refusal_forgets_it_quietly() {
        let log = Log::default();
        let mut r = Reconciler::new(log.clone(), DiscoveryMetrics::default());
        let t = template();
        let one = |name: &str, ip: &str, serving: bool| {
            BTreeMap::from([(name.to_string(), (t.spec(name.to_string(), ip, t.ports), serving))])
        };
        r.apply_serving(one("a", "10.0.0.1", false)).await;
        r.apply_serving(one("a", "10.0.0.9", true)).await;
        r.apply_serving(one("bad", "10.0.0.2", false)).await;
        assert_eq!(
            *log.0.lock().unwrap(),
            [
                "not serving a",
                "+a@http://10.0.0.1:8000",
                "+a@http://10.0.0.9:8000",
                "serving a",
                "-a",
                "not serving bad",
                "+bad@http://10.0.0.2:8000",
                "+bad@http://10.0.0.2:8000",
                "serving bad",
            ]
        );
        assert_eq!(
            r.metrics.changes.get_or_create(&OpLabel { op: "serving" }).get(),
            1,
            "the refusal is no change"
        );
        assert!(r.not_serving.is_empty());
    }
}
