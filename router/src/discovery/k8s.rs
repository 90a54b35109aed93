//! Kubernetes discovery: watch a Service's EndpointSlices and turn every endpoint that is
//! not terminating into a replica, serving while it is Ready (see the parent module for the
//! rules).
//!
//! The watcher lists, then watches from the list's resourceVersion. Its events are folded
//! into a map slice (family, name) → replicas: `Init` … `InitApply` … `InitDone` (a first list, or a
//! re-list after `410 Gone`) replace the whole map at `InitDone`, so slices deleted while
//! the watch was down disappear too; `Apply` / `Delete` replace or drop one slice. After
//! every change the union over slices (if a pod is in two, as happens briefly while the
//! controller moves it and always in a dual-stack Service, an IPv4 slice wins, then the
//! first by name) goes to the [`Reconciler`]. Watch errors
//! are counted and retried with kube's default backoff (0.8 s doubling to 30 s).
//!
//! With `--discovery-pod-annotations`, every listed pod is read once (`GET pod`, cached by
//! name until its UID changes or it leaves the listing) and its `kvroute.io/*` annotations
//! ([`PodOverrides`]) win over the slice's named ports and the configured defaults. A read
//! that failed is tried again at a retry (every `--discovery-interval-ms`) once its wait is
//! over (the interval, doubling to 5 min; every one is due again once a read succeeds), and
//! a retry makes no read past one that fails; meanwhile the slice's ports apply.

use std::collections::{BTreeMap, HashMap};
use std::pin::pin;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;

use super::{PortNames, Ports, Reconciler, ReplicaSink, ReplicaTemplate};
use crate::replicas::{EngineKind, ReplicaSpec, Role};

/// The label the EndpointSlice controller puts on every slice of a Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Which Service to follow and how to read its slices.
#[derive(Clone, Debug)]
pub struct SliceSource {
    pub service: String,
    pub template: ReplicaTemplate,
    pub port_names: PortNames,
}

/// Slice name → its replicas and whether each is serving.
type Slices = BTreeMap<String, Vec<(ReplicaSpec, bool)>>;

/// Slice name → the slice, for slices a pod of which could not be looked up: read again
/// every retry until every pod's annotations are in.
type Unread = BTreeMap<String, EndpointSlice>;

/// An endpoint of a slice that is not terminating, before pod annotations.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ListedEndpoint {
    /// The pod's name (`targetRef`), else the address.
    name: String,
    address: String,
    /// The pod's UID, if the endpoint names a pod.
    pod_uid: Option<String>,
    is_pod: bool,
    ports: Ports,
    /// Ready and serving: may be routed to.
    serving: bool,
}

impl SliceSource {
    /// Follows the slices until `shutdown`. With `pods`, Ready pods' `kvroute.io/*`
    /// annotations override what the slice says ([`PodOverrides`]). Every `retry` the slices
    /// are applied again: a replica the sink refused (its old entry still being removed) is
    /// tried again without waiting for its slice to change, and so is a pod lookup that
    /// failed (meanwhile the slice's ports apply).
    pub async fn run<S: ReplicaSink>(
        self,
        api: Api<EndpointSlice>,
        pods: Option<Api<Pod>>,
        mut reconciler: Reconciler<S>,
        retry: std::time::Duration,
        shutdown: CancellationToken,
    ) {
        let config = watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={}", self.service));
        let mut events = pin!(watcher(api, config).default_backoff());
        let mut annotations = pods.map(|api| Annotations::new(api, retry));
        let mut slices = Slices::new();
        let mut unread = Unread::new();
        // Slices of a listing in progress (between `Init` and `InitDone`), and those of them
        // with a pod not looked up.
        let mut listing: Option<(Slices, Unread)> = None;
        let mut again = tokio::time::interval_at(tokio::time::Instant::now() + retry, retry);
        again.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => event,
                _ = again.tick(), if listing.is_none() => {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = async {
                            // No lookup past one that fails (the API server is in trouble: the
                            // rest wait for the next retry, and the watch is not held up).
                            if let Some(a) = annotations.as_mut() {
                                a.stop_after = Some(a.failures);
                            }
                            for (key, slice) in std::mem::take(&mut unread) {
                                let replicas = self.resolve(&slice, &mut annotations, &reconciler).await;
                                keep(&mut slices, &mut unread, key, slice, replicas);
                            }
                            if let Some(a) = annotations.as_mut() {
                                a.stop_after = None;
                            }
                            apply(&slices, &mut annotations, &mut reconciler).await;
                        } => continue,
                    }
                }
            };
            let Some(event) = event else { return };
            // No lookup past one that fails, for a change or a whole listing as for a retry
            // pass: an API server that stops answering pod reads (each waits out its timeout)
            // would hold every later change, a pod that terminates included.
            if let Some(a) = annotations.as_mut()
                && !matches!(event, Ok(watcher::Event::InitApply(_)))
            {
                a.stop_after = Some(a.failures);
            }
            // A pod lookup (`--discovery-pod-annotations`) may wait on the API server: a
            // shutdown does not wait for it.
            let handled = async {
                match event {
                    Ok(watcher::Event::Init) => listing = Some(Default::default()),
                    Ok(watcher::Event::InitApply(slice)) => {
                        let replicas = self.resolve(&slice, &mut annotations, &reconciler).await;
                        let (listed, listed_unread) = listing.get_or_insert_default();
                        keep(listed, listed_unread, slice_key(&slice), slice, replicas);
                    }
                    Ok(watcher::Event::InitDone) => {
                        (slices, unread) = listing.take().unwrap_or_default();
                        apply(&slices, &mut annotations, &mut reconciler).await;
                    }
                    Ok(watcher::Event::Apply(slice)) => {
                        let replicas = self.resolve(&slice, &mut annotations, &reconciler).await;
                        keep(&mut slices, &mut unread, slice_key(&slice), slice, replicas);
                        apply(&slices, &mut annotations, &mut reconciler).await;
                    }
                    Ok(watcher::Event::Delete(slice)) => {
                        let key = slice_key(&slice);
                        slices.remove(&key);
                        unread.remove(&key);
                        apply(&slices, &mut annotations, &mut reconciler).await;
                    }
                    Err(e) => reconciler.error(&e),
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = handled => {}
            }
        }
    }

    /// The endpoints of one slice that are not terminating as replicas (named ports, else
    /// configured ports), with whether each is serving.
    pub fn replicas(&self, slice: &EndpointSlice) -> Vec<(ReplicaSpec, bool)> {
        self.listed_endpoints(slice).into_iter().map(|ep| (self.spec(&ep, None), ep.serving)).collect()
    }

    /// The slice's replicas, with each pod's annotations; and whether every pod's
    /// annotations are in (a lookup that failed leaves its pod on the slice's ports).
    async fn resolve<S: ReplicaSink>(
        &self,
        slice: &EndpointSlice,
        annotations: &mut Option<Annotations>,
        reconciler: &Reconciler<S>,
    ) -> (Vec<(ReplicaSpec, bool)>, bool) {
        let mut replicas = Vec::new();
        let mut whole = true;
        for ep in self.listed_endpoints(slice) {
            let overrides = match annotations {
                Some(a) if ep.is_pod => {
                    let read = a.overrides(&ep, reconciler).await;
                    whole &= read.is_some();
                    read
                }
                _ => None,
            };
            replicas.push((self.spec(&ep, overrides.as_ref()), ep.serving));
        }
        (replicas, whole)
    }

    fn listed_endpoints(&self, slice: &EndpointSlice) -> Vec<ListedEndpoint> {
        let named = |name: &str| {
            slice
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some(name))
                .and_then(|p| p.port)
                .and_then(|p| u16::try_from(p).ok())
        };
        let defaults = self.template.ports;
        let names = &self.port_names;
        let ports = Ports {
            http: named(&names.http).unwrap_or(defaults.http),
            events: named(&names.events).unwrap_or(defaults.events),
            replay: named(&names.replay).or(defaults.replay),
            grpc: named(&names.grpc).or(defaults.grpc),
        };
        slice
            .endpoints
            .iter()
            .filter_map(|ep| {
                // A missing condition means "unknown", read as ready, serving and not
                // terminating (the API's guidance for consumers). A terminating pod is gone; one
                // that is not ready (a readiness probe that timed out, a model still loading) is
                // kept and not routed to. `serving` is `ready` regardless of terminating, so it
                // only matters with `publishNotReadyAddresses`, where `ready` is always true.
                let conditions = ep.conditions.as_ref();
                if conditions.and_then(|c| c.terminating) == Some(true) {
                    return None;
                }
                let serving = conditions.is_none_or(|c| c.ready != Some(false) && c.serving != Some(false));
                let address = ep.addresses.first()?.clone();
                let pod = ep.target_ref.as_ref().filter(|r| r.kind.as_deref() == Some("Pod"));
                let pod_name = pod.and_then(|r| r.name.clone());
                Some(ListedEndpoint {
                    is_pod: pod_name.is_some(),
                    name: pod_name.unwrap_or_else(|| address.clone()),
                    pod_uid: pod.and_then(|r| r.uid.clone()),
                    address,
                    ports,
                    serving,
                })
            })
            .collect()
    }

    fn spec(&self, ep: &ListedEndpoint, overrides: Option<&PodOverrides>) -> ReplicaSpec {
        let Some(o) = overrides else {
            return self.template.spec(ep.name.clone(), &ep.address, ep.ports);
        };
        let ports = Ports {
            http: o.http.unwrap_or(ep.ports.http),
            events: o.events.unwrap_or(ep.ports.events),
            replay: o.replay.or(ep.ports.replay),
            grpc: o.grpc.or(ep.ports.grpc),
        };
        let mut spec = self.template.spec(ep.name.clone(), &ep.address, ports);
        spec.engine = o.engine.unwrap_or(spec.engine);
        spec.dp_size = o.dp_size.unwrap_or(spec.dp_size);
        spec.role = o.role.unwrap_or(spec.role);
        spec.bootstrap_port = o.bootstrap_port.or(spec.bootstrap_port);
        if let Some(topic) = &o.topic {
            spec.topic.clone_from(topic);
        }
        spec
    }
}

/// Records a slice's resolved replicas under `key`, and the slice in `unread` if one
/// of its pods was not looked up.
fn keep(
    slices: &mut Slices,
    unread: &mut Unread,
    key: String,
    slice: EndpointSlice,
    (replicas, whole): (Vec<(ReplicaSpec, bool)>, bool),
) {
    slices.insert(key.clone(), replicas);
    if whole {
        unread.remove(&key);
    } else {
        unread.insert(key, slice);
    }
}

async fn apply<S: ReplicaSink>(
    slices: &Slices,
    annotations: &mut Option<Annotations>,
    reconciler: &mut Reconciler<S>,
) {
    let all = union(slices);
    if let Some(a) = annotations {
        // Forget pods that left: their annotations are read again if they come back.
        a.cache.retain(|name, _| all.contains_key(name));
        a.failed.retain(|name, _| all.contains_key(name));
    }
    reconciler.apply_serving(all).await;
}

/// Pod annotations (prefix `kvroute.io/`) that override what the slice says about a replica:
/// `http-port`, `kv-events-port`, `kv-replay-port`, `grpc-port`, `engine`
/// (`kvroute|vllm|sglang`), `dp-size`, `topic`, `role` (`both|prefill|decode`),
/// `bootstrap-port` (an SGLang prefill replica's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodOverrides {
    pub http: Option<u16>,
    pub events: Option<u16>,
    pub replay: Option<u16>,
    pub grpc: Option<u16>,
    pub engine: Option<EngineKind>,
    pub dp_size: Option<u32>,
    pub topic: Option<String>,
    pub role: Option<Role>,
    pub bootstrap_port: Option<u16>,
}

/// The annotation prefix [`PodOverrides`] reads.
pub const ANNOTATION_PREFIX: &str = "kvroute.io/";

impl PodOverrides {
    /// Reads the overrides; returns the keys whose values do not parse (they are ignored).
    pub fn from_annotations(annotations: &BTreeMap<String, String>) -> (Self, Vec<String>) {
        let mut o = PodOverrides::default();
        let mut bad = Vec::new();
        for (key, value) in annotations {
            let Some(field) = key.strip_prefix(ANNOTATION_PREFIX) else { continue };
            let value = value.trim();
            let port = || value.parse::<u16>().ok().filter(|p| *p != 0);
            let ok = match field {
                "http-port" => port().map(|p| o.http = Some(p)).is_some(),
                "kv-events-port" => port().map(|p| o.events = Some(p)).is_some(),
                "kv-replay-port" => port().map(|p| o.replay = Some(p)).is_some(),
                "grpc-port" => port().map(|p| o.grpc = Some(p)).is_some(),
                "bootstrap-port" => port().map(|p| o.bootstrap_port = Some(p)).is_some(),
                "engine" => {
                    <EngineKind as clap::ValueEnum>::from_str(value, true).map(|e| o.engine = Some(e)).is_ok()
                }
                "role" => <Role as clap::ValueEnum>::from_str(value, true).map(|r| o.role = Some(r)).is_ok(),
                "dp-size" => {
                    value.parse::<u32>().ok().filter(|n| *n > 0).map(|n| o.dp_size = Some(n)).is_some()
                }
                "topic" => {
                    o.topic = Some(value.to_owned());
                    true
                }
                _ => true,
            };
            if !ok {
                bad.push(key.clone());
            }
        }
        (o, bad)
    }
}

/// Reads and caches Ready pods' annotations (by pod name, refreshed when its UID changes).
struct Annotations {
    api: Api<Pod>,
    cache: HashMap<String, (Option<String>, PodOverrides)>,
    /// Pods whose lookup failed: when to try again, and the wait after that.
    failed: HashMap<String, (tokio::time::Instant, std::time::Duration)>,
    /// Lookups that failed, ever.
    failures: u64,
    /// `failures` as the retry pass, the listing or the change being read began: past it, no
    /// lookup is made (the rest wait for the next retry pass).
    stop_after: Option<u64>,
    /// The first wait before a failed lookup is tried again (the retry interval); it doubles
    /// with each failure, to [`POD_RETRY_MOST`].
    first_wait: std::time::Duration,
}

/// The longest wait between tries of a pod's lookup.
const POD_RETRY_MOST: std::time::Duration = std::time::Duration::from_secs(300);

impl Annotations {
    fn new(api: Api<Pod>, first_wait: std::time::Duration) -> Self {
        Self { api, cache: HashMap::new(), failed: HashMap::new(), failures: 0, stop_after: None, first_wait }
    }

    /// Records a failed lookup of `pod`; says it at the first failure of a run, counts the
    /// others quietly.
    fn failed<S: ReplicaSink>(
        &mut self,
        pod: &str,
        error: &dyn std::error::Error,
        reconciler: &Reconciler<S>,
    ) {
        self.failures += 1;
        let now = tokio::time::Instant::now();
        match self.failed.get_mut(pod) {
            Some((next, wait)) => {
                *wait = (*wait * 2).min(POD_RETRY_MOST);
                *next = now + *wait;
                reconciler.error_again(error);
            }
            None => {
                tracing::warn!(%pod, "discovery: pod lookup failed; its slice's ports apply until it is read");
                self.failed.insert(pod.to_owned(), (now + self.first_wait, self.first_wait));
                reconciler.error(error);
            }
        }
    }

    async fn overrides<S: ReplicaSink>(
        &mut self,
        ep: &ListedEndpoint,
        reconciler: &Reconciler<S>,
    ) -> Option<PodOverrides> {
        if let Some((uid, overrides)) = self.cache.get(&ep.name)
            && *uid == ep.pod_uid
        {
            return Some(overrides.clone());
        }
        // Failed lately: not asked again before its wait is over (due at the retry that
        // comes about then). Nor past a failure of this retry pass.
        let now = tokio::time::Instant::now();
        if self.failed.get(&ep.name).is_some_and(|(next, _)| now + self.first_wait / 2 < *next)
            || self.stop_after.is_some_and(|at| self.failures > at)
        {
            return None;
        }
        // The client sets no read timeout: an API server that stops answering would hold
        // every later change.
        let looked_up = match tokio::time::timeout(POD_LOOKUP_TIMEOUT, self.api.get_opt(&ep.name)).await {
            Ok(looked_up) => looked_up,
            Err(elapsed) => {
                // Not cached either: tried again once its wait is over.
                tracing::debug!(pod = %ep.name, timeout = ?POD_LOOKUP_TIMEOUT, "discovery: pod lookup timed out");
                self.failed(&ep.name, &elapsed, reconciler);
                return None;
            }
        };
        match looked_up {
            Ok(pod) => {
                let annotations = pod.and_then(|p| p.metadata.annotations).unwrap_or_default();
                let (overrides, bad) = PodOverrides::from_annotations(&annotations);
                if !bad.is_empty() {
                    tracing::warn!(pod = %ep.name, annotations = ?bad, "discovery: ignoring unparsable annotations");
                }
                self.cache.insert(ep.name.clone(), (ep.pod_uid.clone(), overrides.clone()));
                // The API answers again: every pod that failed is due now (a new failure
                // goes on doubling its wait).
                self.failed.remove(&ep.name);
                for (next, _) in self.failed.values_mut() {
                    *next = now;
                }
                Some(overrides)
            }
            Err(e) => {
                // Not cached: tried again once its wait is over; meanwhile the slice's ports
                // apply.
                self.failed(&ep.name, &e, reconciler);
                None
            }
        }
    }
}

/// How long a pod's annotations may take to come (`--discovery-pod-annotations`).
const POD_LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A slice's key in [`Slices`]: its name, after its address family's rank, so that IPv4
/// slices come first. A dual-stack Service has an IPv4 and an IPv6 slice of the same pods,
/// and engines listen on IPv4 (vLLM's `tcp://*:5557`, uvicorn's `0.0.0.0`), as DNS
/// discovery prefers it too.
fn slice_key(slice: &EndpointSlice) -> String {
    let rank = if slice.address_type == "IPv4" { '0' } else { '1' };
    format!("{rank}{}", slice.metadata.name.as_deref().unwrap_or_default())
}

/// Every slice's replicas, one per pod: the first slice's (by [`slice_key`]) that lists it.
fn union(slices: &Slices) -> BTreeMap<String, (ReplicaSpec, bool)> {
    let mut all = BTreeMap::new();
    for (spec, serving) in slices.values().flatten() {
        all.entry(spec.name.clone()).or_insert_with(|| (spec.clone(), *serving));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::DiscoveryConfig;

    fn slice(json: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json).unwrap()
    }

    /// The slices of Service `service`, as `config` and a block size make replicas of them.
    fn source(service: &str, config: &DiscoveryConfig, block_size: Option<u32>) -> SliceSource {
        SliceSource {
            service: service.into(),
            template: config.template("m", block_size),
            port_names: config.port_names(),
        }
    }

    /// Terminating endpoints leave; endpoints that are not Ready (or, with
    /// `publishNotReadyAddresses`, not serving) stay, not serving; a missing condition reads as
    /// ready.
    #[test]
    fn endpoints_not_terminating_become_replicas_serving_while_ready() {
        let config = DiscoveryConfig::default();
        let source = source("agents", &config, Some(16));
        let s = slice(serde_json::json!({
            "metadata": {"name": "agents-x"},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true},
                 "targetRef": {"kind": "Pod", "name": "agent-0"}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": false, "terminating": true},
                 "targetRef": {"kind": "Pod", "name": "agent-1"}},
                {"addresses": ["10.0.0.3"]},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": false, "serving": false, "terminating": false},
                 "targetRef": {"kind": "Pod", "name": "agent-4"}},
                {"addresses": ["10.0.0.5"], "conditions": {"ready": true, "serving": true, "terminating": true},
                 "targetRef": {"kind": "Pod", "name": "agent-5"}},
                {"addresses": ["10.0.0.6"], "conditions": {"ready": true, "serving": false},
                 "targetRef": {"kind": "Pod", "name": "agent-6"}},
            ],
            "ports": [
                {"name": "http", "port": 9000},
                {"name": "kv-events", "port": 6000},
                {"name": "grpc", "port": 50051},
            ],
        }));
        let replicas = source.replicas(&s);
        let names: Vec<_> = replicas.iter().map(|(r, serving)| (r.name.as_str(), *serving)).collect();
        assert_eq!(names, [("agent-0", true), ("10.0.0.3", true), ("agent-4", false), ("agent-6", false)]);
        let r = &replicas[0].0;
        assert_eq!(r.http_url, "http://10.0.0.1:9000");
        assert_eq!(r.event_endpoint, "tcp://10.0.0.1:6000");
        assert_eq!(r.replay_endpoint, None, "no kv-replay port and no default");
        assert_eq!(r.grpc_endpoint.as_deref(), Some("http://10.0.0.1:50051"));
    }

    #[test]
    fn pod_annotations_parse_and_bad_ones_are_reported() {
        let annotations: BTreeMap<String, String> = [
            ("kvroute.io/kv-events-port", "6000"),
            ("kvroute.io/kv-replay-port", "0"),
            ("kvroute.io/engine", "SGLang"),
            ("kvroute.io/dp-size", "2"),
            ("kvroute.io/topic", "kv@x"),
            ("kvroute.io/role", "Prefill"),
            ("kvroute.io/bootstrap-port", "8998"),
            ("kvroute.io/grpc-port", "http"),
            ("other.io/http-port", "1"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let (o, bad) = PodOverrides::from_annotations(&annotations);
        assert_eq!(
            o,
            PodOverrides {
                events: Some(6000),
                engine: Some(EngineKind::Sglang),
                dp_size: Some(2),
                topic: Some("kv@x".into()),
                role: Some(Role::Prefill),
                bootstrap_port: Some(8998),
                ..PodOverrides::default()
            }
        );
        assert_eq!(bad, ["kvroute.io/grpc-port", "kvroute.io/kv-replay-port"]);
    }

    #[test]
    fn unnamed_ports_fall_back_to_the_configured_numbers() {
        let config = DiscoveryConfig { discovery_replay_port: Some(5558), ..DiscoveryConfig::default() };
        let source = source("vllm", &config, None);
        let s = slice(serde_json::json!({
            "metadata": {"name": "vllm-x"},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "vllm-0"}}],
            "ports": [{"name": "openai", "port": 8000}],
        }));
        let r = &source.replicas(&s)[0].0;
        assert_eq!(r.http_url, "http://10.0.0.1:8000");
        assert_eq!(r.event_endpoint, "tcp://10.0.0.1:5557");
        assert_eq!(r.replay_endpoint.as_deref(), Some("tcp://10.0.0.1:5558"));
    }

    /// A dual-stack Service lists each pod in an IPv4 and an IPv6 slice: the replica is the
    /// IPv4 one, whichever slice's name sorts first; an IPv6-only pod stays.
    #[test]
    fn a_dual_stack_service_gives_each_pod_its_ipv4_address() {
        let config = DiscoveryConfig::default();
        let source = source("agents", &config, Some(16));
        let of = |name: &str, family: &str, pods: &[(&str, &str)]| {
            let endpoints: Vec<_> = pods
                .iter()
                .map(|(pod, address)| serde_json::json!({"addresses": [address], "targetRef": {"kind": "Pod", "name": pod}}))
                .collect();
            slice(
                serde_json::json!({"metadata": {"name": name}, "addressType": family, "endpoints": endpoints}),
            )
        };
        let mut slices = Slices::new();
        for s in [
            of("agents-a", "IPv6", &[("agent-0", "fd00::1"), ("agent-1", "fd00::2")]),
            of("agents-z", "IPv4", &[("agent-0", "10.0.0.1")]),
        ] {
            slices.insert(slice_key(&s), source.replicas(&s));
        }
        let all = union(&slices);
        assert_eq!(
            all["agent-0"].0.http_url,
            format!("http://10.0.0.1:{}", config.template("m", None).ports.http)
        );
        assert!(all["agent-1"].0.http_url.starts_with("http://[fd00::2]:"), "{:?}", all["agent-1"]);
    }
}
