//! Discovery end to end: DNS mode against `localhost`, and (feature `k8s`) kube's real
//! client and watcher against a fake API server serving EndpointSlice list/watch, through
//! readiness changes, a dropped watch that resumes, a `410 Gone` that re-lists, and into
//! ingestion (removing a replica frees its index entries).

#[cfg(feature = "k8s")]
mod fake_api;

use kvroute_router::discovery::{Discovery, DiscoveryConfig, DiscoveryMetrics, DiscoveryMode};
use kvroute_router::replicas::EngineKind;

use crate::support::{BLOCK, Harness, MODEL, WAIT};

#[tokio::test]
async fn dns_discovery_registers_localhost_with_the_configured_ports() {
    let h = Harness::start();
    let config = DiscoveryConfig {
        discovery: DiscoveryMode::Dns,
        discovery_service: Some("localhost".into()),
        discovery_events_port: 1,
        discovery_grpc_port: Some(2),
        ..DiscoveryConfig::default()
    };
    let template = config.template(MODEL, Some(BLOCK));
    let discovery = Discovery::start(
        &config,
        template,
        h.ingest.clone(),
        DiscoveryMetrics::default(),
        &h.tracker,
        h.shutdown.clone(),
    )
    .await
    .unwrap();
    tokio::time::timeout(WAIT, discovery.wait_listed()).await.expect("listed");
    let replicas = h.ingest.replicas().list();
    assert!(!replicas.is_empty());
    for r in &replicas {
        let ip: std::net::IpAddr = r.spec.name.parse().expect("named by IP");
        assert!(ip.is_loopback());
        assert!(r.spec.event_endpoint.ends_with(":1"), "{}", r.spec.event_endpoint);
        assert!(r.spec.grpc_endpoint.as_deref().is_some_and(|g| g.ends_with(":2")));
        assert_eq!(r.spec.engine, EngineKind::Kvroute);
    }
}

/// Discovery's removal of a replica named by its address forgets its drain: the address
/// may come back as an unrelated pod, which must not start drained. A pod's name keeps it.
#[tokio::test]
async fn a_drain_ends_with_an_address_discovery_removed() {
    use kvroute_router::discovery::ReplicaSink;
    use kvroute_router::fleet::Fleet;
    use kvroute_router::replicas::ReplicaSpec;
    let h = Harness::start();
    let fleet = Fleet::new(h.ingest.clone());
    for name in ["10.0.0.5", "vllm-0"] {
        let spec = ReplicaSpec::new(name, crate::support::nowhere(), EngineKind::Vllm, MODEL);
        fleet.upsert(spec.clone()).await.unwrap();
        fleet.set_draining(name, true).unwrap();
        ReplicaSink::remove(&fleet, name).await;
        fleet.upsert(spec).await.unwrap();
        let draining = fleet.member(name).unwrap().upstream.is_draining();
        assert_eq!(draining, name == "vllm-0", "{name}");
    }
}

#[tokio::test]
async fn k8s_mode_without_a_service_is_refused() {
    let h = Harness::start();
    let config = DiscoveryConfig { discovery: DiscoveryMode::K8s, ..DiscoveryConfig::default() };
    let started = Discovery::start(
        &config,
        config.template(MODEL, None),
        h.ingest.clone(),
        DiscoveryMetrics::default(),
        &h.tracker,
        h.shutdown.clone(),
    )
    .await;
    assert!(started.is_err());
}

#[cfg(feature = "k8s")]
mod k8s {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::{Arc, Mutex};

    use kvroute_proto::pb::EventBatch;
    use kvroute_replica_agent::publisher::EventFormat;
    use kvroute_router::discovery::{
        Discovery, DiscoveryConfig, DiscoveryMetrics, DiscoveryMode, ReplicaSink,
    };
    use kvroute_router::fleet::Fleet;
    use kvroute_router::replicas::{EngineKind, ReplicaSpec};
    use serde_json::{Value, json};
    use tokio::sync::watch;
    use tokio_util::sync::CancellationToken;
    use tokio_util::task::TaskTracker;

    use super::fake_api::FakeApi;
    use crate::support::{AgentPublisher, BLOCK, Harness, MODEL, Rng, WAIT, batch, store_chain, wait_until};

    const NS: &str = "kvroute";

    /// A sink whose replica set (name → spec, serving) the test can await; like the fleet, it
    /// keeps serving by name.
    #[derive(Clone)]
    struct Set(Arc<watch::Sender<BTreeMap<String, (ReplicaSpec, bool)>>>, Arc<Mutex<BTreeSet<String>>>);

    impl ReplicaSink for Set {
        type Error = std::convert::Infallible;
        async fn upsert(&self, spec: ReplicaSpec) -> Result<(), Self::Error> {
            let serving = !self.1.lock().unwrap().contains(&spec.name);
            self.0.send_modify(|s| drop(s.insert(spec.name.clone(), (spec, serving))));
            Ok(())
        }
        async fn remove(&self, name: &str) {
            self.1.lock().unwrap().remove(name);
            self.0.send_modify(|s| drop(s.remove(name)));
        }
        fn set_serving(&self, name: &str, serving: bool) {
            if serving {
                self.1.lock().unwrap().remove(name);
            } else {
                self.1.lock().unwrap().insert(name.to_owned());
            }
            self.0.send_modify(|s| s.get_mut(name).into_iter().for_each(|(_, s)| *s = serving));
        }
    }

    impl Set {
        /// Waits (bounded) until the replica names are `names`, the serving ones `serving`.
        async fn names(&self, names: &[&str], serving: &[&str]) -> BTreeMap<String, ReplicaSpec> {
            let mut rx = self.0.subscribe();
            let got = tokio::time::timeout(
                WAIT,
                rx.wait_for(|s| {
                    s.keys().map(String::as_str).eq(names.iter().copied())
                        && s.iter()
                            .filter(|(_, (_, on))| *on)
                            .map(|(n, _)| n.as_str())
                            .eq(serving.iter().copied())
                }),
            )
            .await;
            match got {
                Ok(set) => {
                    set.expect("sink alive").iter().map(|(n, (spec, _))| (n.clone(), spec.clone())).collect()
                }
                Err(_) => {
                    panic!("replicas never became {names:?} serving {serving:?}; last {:?}", self.0.borrow())
                }
            }
        }
    }

    fn ports(events: u16, replay: u16) -> Value {
        json!([
            {"name": "http", "port": 8000, "protocol": "TCP"},
            {"name": "kv-events", "port": events, "protocol": "TCP"},
            {"name": "kv-replay", "port": replay, "protocol": "TCP"},
            {"name": "grpc", "port": 50051, "protocol": "TCP"},
        ])
    }

    /// An EndpointSlice of `service` with `(pod, ip, ready)` endpoints, none terminating.
    fn slice(name: &str, service: &str, pods: &[(&str, &str, bool)], ports: Value) -> Value {
        let pods: Vec<_> = pods.iter().map(|&(pod, ip, ready)| (pod, ip, ready, false)).collect();
        slice_terminating(name, service, &pods, ports)
    }

    /// An EndpointSlice of `service` with `(pod, ip, ready, terminating)` endpoints.
    fn slice_terminating(
        name: &str,
        service: &str,
        pods: &[(&str, &str, bool, bool)],
        ports: Value,
    ) -> Value {
        let endpoints: Vec<Value> = pods
            .iter()
            .map(|(pod, ip, ready, terminating)| {
                json!({
                    "addresses": [ip],
                    "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
                    "targetRef": {"kind": "Pod", "name": pod, "namespace": NS},
                })
            })
            .collect();
        json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": ports,
        })
    }

    fn client(api: &FakeApi) -> kube::Client {
        let mut config = kube::Config::new(api.url().parse().expect("url"));
        config.default_namespace = NS.into();
        kube::Client::try_from(config).expect("kube client")
    }

    fn config(service: &str) -> DiscoveryConfig {
        DiscoveryConfig {
            discovery: DiscoveryMode::K8s,
            discovery_service: Some(service.into()),
            ..DiscoveryConfig::default()
        }
    }

    /// A sink that refuses the first adds of each name in its list, as many as the list says
    /// (as the fleet refuses a replica whose old entry is still being removed).
    #[derive(Clone)]
    struct Refuses(Set, Arc<Mutex<BTreeMap<String, usize>>>);

    #[derive(Debug, thiserror::Error)]
    #[error("still removing {0}")]
    struct Busy(String);

    impl ReplicaSink for Refuses {
        type Error = Busy;
        async fn upsert(&self, spec: ReplicaSpec) -> Result<(), Busy> {
            if let Some(left) = self.1.lock().unwrap().get_mut(&spec.name).filter(|left| **left > 0) {
                *left -= 1;
                return Err(Busy(spec.name));
            }
            self.0.upsert(spec).await.map_err(|never| match never {})
        }
        async fn remove(&self, name: &str) {
            self.0.remove(name).await;
        }
        fn set_serving(&self, name: &str, serving: bool) {
            self.0.set_serving(name, serving);
        }
    }

    /// A replica the sink refused (at both tries of a listing) is added on a later pass over
    /// the slices, though its slice does not change again (it waited for the next event of
    /// the Service's slices).
    #[tokio::test]
    async fn a_refused_replica_is_tried_again_without_a_new_event() {
        let api = FakeApi::start().await;
        api.apply(slice("agents-a", "agents", &[("agent-0", "10.0.0.1", true)], ports(5557, 5558)));
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())), Arc::default());
        let sink = Refuses(set.clone(), Arc::new(Mutex::new(BTreeMap::from([("agent-0".to_owned(), 2)]))));
        let (tracker, shutdown) = (TaskTracker::new(), CancellationToken::new());
        let config = DiscoveryConfig { discovery_interval_ms: 100, ..config("agents") };
        let template = config.template(MODEL, Some(BLOCK));
        let metrics = DiscoveryMetrics::default();
        Discovery::start_k8s(client(&api), &config, template, sink, metrics, &tracker, shutdown.clone())
            .unwrap();
        set.names(&["agent-0"], &["agent-0"]).await;
        shutdown.cancel();
        tracker.close();
        tracker.wait().await;
    }

    #[tokio::test]
    async fn endpointslice_watch_follows_readiness_drops_and_410_gone() {
        let api = FakeApi::start().await;
        api.apply(slice(
            "agents-a",
            "agents",
            &[("agent-0", "10.0.0.1", true), ("agent-1", "10.0.0.2", false)],
            ports(5557, 5558),
        ));
        api.apply(slice("other-x", "other", &[("other-0", "10.9.9.9", true)], ports(5557, 5558)));
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())), Arc::default());
        let (tracker, shutdown) = (TaskTracker::new(), CancellationToken::new());
        let config = config("agents");
        let discovery = Discovery::start_k8s(
            client(&api),
            &config,
            config.template(MODEL, Some(BLOCK)),
            set.clone(),
            DiscoveryMetrics::default(),
            &tracker,
            shutdown.clone(),
        )
        .unwrap();

        // The first listing: this Service's endpoints; the one that is not Ready is kept but
        // not serving.
        let first = set.names(&["agent-0", "agent-1"], &["agent-0"]).await;
        assert!(discovery.is_listed());
        let spec = &first["agent-0"];
        assert_eq!(spec.http_url, "http://10.0.0.1:8000");
        assert_eq!(spec.event_endpoint, "tcp://10.0.0.1:5557");
        assert_eq!(spec.replay_endpoint.as_deref(), Some("tcp://10.0.0.1:5558"));
        assert_eq!(spec.grpc_endpoint.as_deref(), Some("http://10.0.0.1:50051"));

        // Watch events: a pod turns Ready, a second slice appears.
        api.apply(slice(
            "agents-a",
            "agents",
            &[("agent-0", "10.0.0.1", true), ("agent-1", "10.0.0.2", true)],
            ports(5557, 5558),
        ));
        set.names(&["agent-0", "agent-1"], &["agent-0", "agent-1"]).await;
        api.apply(slice("agents-b", "agents", &[("agent-2", "10.0.0.3", true)], ports(5557, 5558)));
        set.names(&["agent-0", "agent-1", "agent-2"], &["agent-0", "agent-1", "agent-2"]).await;

        // The watch drops; a change happens while it is down; the watcher resumes from its
        // resourceVersion (no second list) and gets the change.
        api.atomically(|s| {
            s.drop_watches();
            s.apply(slice(
                "agents-a",
                "agents",
                &[("agent-0", "10.0.0.1", false), ("agent-1", "10.0.0.2", true)],
                ports(5557, 5558),
            ));
        });
        set.names(&["agent-0", "agent-1", "agent-2"], &["agent-1", "agent-2"]).await;
        assert_eq!(api.lists(), 1, "a dropped watch resumes without re-listing");
        let watches = api.watches();
        assert!(watches.len() >= 2 && watches[1] > watches[0], "resumed from a later version: {watches:?}");

        // The watch drops and the history is gone: 410, re-list; a slice deleted meanwhile
        // disappears with its replicas, and so does a pod that is terminating.
        api.atomically(|s| {
            s.drop_watches();
            s.delete("agents-b");
            s.apply(slice_terminating(
                "agents-a",
                "agents",
                &[("agent-0", "10.0.0.1", false, true), ("agent-1", "10.0.0.2", true, false)],
                ports(5557, 5558),
            ));
            s.expire_history();
        });
        set.names(&["agent-1"], &["agent-1"]).await;
        assert_eq!(api.lists(), 2, "410 Gone re-lists");

        // A pod that comes back with another IP is updated in place.
        api.apply(slice("agents-a", "agents", &[("agent-1", "10.0.0.22", true)], ports(5557, 5558)));
        wait_until("agent-1 moves", || {
            set.0.borrow().get("agent-1").is_some_and(|(s, _)| s.http_url == "http://10.0.0.22:8000")
        })
        .await;

        // The Service's last slice is deleted.
        api.delete("agents-a");
        set.names(&[], &[]).await;

        shutdown.cancel();
        tracker.close();
        tracker.wait().await;
    }

    fn pod(name: &str, uid: &str, annotations: Value) -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "uid": uid, "annotations": annotations},
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        })
    }

    /// `slice` whose endpoints also carry the pods' UIDs.
    fn slice_with_uids(name: &str, pods: &[(&str, &str, &str)]) -> Value {
        let mut s = slice(
            name,
            "vllm",
            &pods.iter().map(|(p, ip, _)| (*p, *ip, true)).collect::<Vec<_>>(),
            ports(5557, 5558),
        );
        for (ep, (_, _, uid)) in s["endpoints"].as_array_mut().unwrap().iter_mut().zip(pods) {
            ep["targetRef"]["uid"] = json!(uid);
        }
        s
    }

    #[tokio::test]
    async fn pod_annotations_override_named_ports_and_are_reread_when_the_pod_changes() {
        let api = FakeApi::start().await;
        api.atomically(|s| {
            s.put_pod(pod("vllm-0", "uid-a", json!({"kvroute.io/kv-events-port": "6000", "kvroute.io/engine": "vllm", "kvroute.io/dp-size": "2"})));
            s.put_pod(pod("vllm-1", "uid-b", json!({"unrelated": "x"})));
            s.apply(slice_with_uids("vllm-a", &[("vllm-0", "10.0.0.1", "uid-a"), ("vllm-1", "10.0.0.2", "uid-b")]));
        });
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())), Arc::default());
        let (tracker, shutdown) = (TaskTracker::new(), CancellationToken::new());
        let config = DiscoveryConfig { discovery_pod_annotations: true, ..config("vllm") };
        Discovery::start_k8s(
            client(&api),
            &config,
            config.template(MODEL, Some(BLOCK)),
            set.clone(),
            DiscoveryMetrics::default(),
            &tracker,
            shutdown.clone(),
        )
        .unwrap();
        let first = set.names(&["vllm-0", "vllm-1"], &["vllm-0", "vllm-1"]).await;
        let annotated = &first["vllm-0"];
        assert_eq!(annotated.event_endpoint, "tcp://10.0.0.1:6000", "annotation wins over the named port");
        assert_eq!(annotated.replay_endpoint.as_deref(), Some("tcp://10.0.0.1:5558"), "named port");
        assert_eq!((annotated.engine, annotated.dp_size), (EngineKind::Vllm, 2));
        assert_eq!(first["vllm-1"].event_endpoint, "tcp://10.0.0.2:5557", "no annotations: named port");
        assert_eq!(first["vllm-1"].engine, EngineKind::Kvroute, "the configured engine");
        assert_eq!(api.pod_gets(), 2);

        // Another slice event: cached, no new reads. Then vllm-0 is recreated (new UID) with
        // other annotations: read again.
        api.apply(slice_with_uids(
            "vllm-a",
            &[("vllm-0", "10.0.0.1", "uid-a"), ("vllm-1", "10.0.0.2", "uid-b")],
        ));
        api.atomically(|s| {
            s.put_pod(pod("vllm-0", "uid-c", json!({"kvroute.io/kv-events-port": "7000"})));
            s.apply(slice_with_uids(
                "vllm-a",
                &[("vllm-0", "10.0.0.9", "uid-c"), ("vllm-1", "10.0.0.2", "uid-b")],
            ));
        });
        wait_until("vllm-0 re-read", || {
            set.0.borrow().get("vllm-0").is_some_and(|(s, _)| s.event_endpoint == "tcp://10.0.0.9:7000")
        })
        .await;
        assert_eq!(set.0.borrow()["vllm-0"].0.dp_size, 1, "the old pod's annotations are gone");
        assert_eq!(api.pod_gets(), 3, "only the recreated pod was read again");

        shutdown.cancel();
        tracker.close();
        tracker.wait().await;
    }

    /// A pod whose lookup failed (the API server erred) is read again at the next retry, its
    /// slice unchanged: until then its slice's ports apply. It kept them until the slice
    /// changed, which may be never.
    #[tokio::test]
    async fn a_pod_lookup_that_failed_is_tried_again() {
        let api = FakeApi::start().await;
        api.atomically(|s| {
            s.pod_failures = 1;
            s.put_pod(pod("vllm-0", "uid-a", json!({"kvroute.io/kv-events-port": "6000"})));
            s.apply(slice_with_uids("vllm-a", &[("vllm-0", "10.0.0.1", "uid-a")]));
        });
        let (set, registry, tracker, shutdown) = with_annotations_every_100_ms(&api);
        wait_until("the annotation read on a retry", || {
            set.0.borrow().get("vllm-0").is_some_and(|(s, _)| s.event_endpoint == "tcp://10.0.0.1:6000")
        })
        .await;
        assert_eq!(api.pod_gets(), 2, "read once more, then cached");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("kvroute_discovery_errors_total 1\n"), "the failed read counted: {text}");

        shutdown.cancel();
        tracker.close();
        tracker.wait().await;
    }

    /// A change read while pod lookups fail looks up no pod past the first that fails: each
    /// may wait out its timeout on an API server that stopped answering, and the change (a
    /// terminating pod) would wait for all of them. The rest are read at the next retry.
    #[tokio::test]
    async fn pod_lookups_stop_at_the_first_that_fails() {
        let api = FakeApi::start().await;
        api.atomically(|s| {
            s.pod_failures = usize::MAX;
            let pods = [
                ("vllm-0", "10.0.0.1", "uid-a"),
                ("vllm-1", "10.0.0.2", "uid-b"),
                ("vllm-2", "10.0.0.3", "uid-c"),
            ];
            s.apply(slice_with_uids("vllm-a", &pods));
        });
        // No retry pass within the test.
        let (set, _registry, tracker, shutdown) = with_annotations(&api, 60_000);
        wait_until("the slice's replicas", || set.0.borrow().len() == 3).await;
        assert_eq!(api.pod_gets(), 1, "no lookup past the failed one");
        // A change with two new pods: one lookup (it fails), not two.
        let pods = [("vllm-3", "10.0.0.4", "uid-d"), ("vllm-4", "10.0.0.5", "uid-e")];
        api.apply(slice_with_uids("vllm-a", &pods));
        wait_until("the change applied", || set.0.borrow().contains_key("vllm-4")).await;
        assert_eq!(api.pod_gets(), 2, "no lookup past the change's failed one");

        shutdown.cancel();
        tracker.close();
        tracker.wait().await;
    }

    /// k8s discovery of `api`'s `vllm` slices, with pods' annotations, retrying every 100 ms;
    /// its replicas, metrics, tasks and shutdown.
    fn with_annotations_every_100_ms(
        api: &FakeApi,
    ) -> (Set, prometheus_client::registry::Registry, TaskTracker, CancellationToken) {
        with_annotations(api, 100)
    }

    /// [`with_annotations_every_100_ms`], retrying every `interval_ms`.
    fn with_annotations(
        api: &FakeApi,
        interval_ms: u64,
    ) -> (Set, prometheus_client::registry::Registry, TaskTracker, CancellationToken) {
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())), Arc::default());
        let (tracker, shutdown) = (TaskTracker::new(), CancellationToken::new());
        let config = DiscoveryConfig {
            discovery_pod_annotations: true,
            discovery_interval_ms: interval_ms,
            ..config("vllm")
        };
        let mut registry = prometheus_client::registry::Registry::default();
        let metrics = DiscoveryMetrics::register(&mut registry);
        Discovery::start_k8s(
            client(api),
            &config,
            config.template(MODEL, Some(BLOCK)),
            set.clone(),
            metrics,
            &tracker,
            shutdown.clone(),
        )
        .unwrap();
        (set, registry, tracker, shutdown)
    }

    /// A pod whose lookups keep failing is tried again after a wait that doubles from the
    /// retry interval (100, 200, 400, 800 ms), not at every retry: its fifth lookup comes a
    /// second and a half after its first, less a retry's slack at each (at every retry, it
    /// came after 400 ms). Meanwhile its slice's ports apply.
    #[tokio::test]
    async fn a_pod_lookup_that_keeps_failing_is_tried_less_and_less_often() {
        let api = FakeApi::start().await;
        api.atomically(|s| {
            s.pod_failures = usize::MAX;
            s.apply(slice_with_uids("vllm-a", &[("vllm-0", "10.0.0.1", "uid-a")]));
        });
        let (set, _registry, tracker, shutdown) = with_annotations_every_100_ms(&api);
        wait_until("the first lookup", || api.pod_gets() >= 1).await;
        let first = std::time::Instant::now();
        wait_until("the fifth lookup", || api.pod_gets() >= 5).await;
        let waited = first.elapsed();
        assert!(waited >= std::time::Duration::from_millis(1_000), "five lookups in {waited:?}");
        assert_eq!(set.0.borrow()["vllm-0"].0.event_endpoint, "tcp://10.0.0.1:5557", "the slice's port");

        shutdown.cancel();
        tracker.close();
        tracker.wait().await;
    }

    fn port_of(endpoint: &str) -> u16 {
        endpoint.rsplit(':').next().and_then(|p| p.parse().ok()).expect("tcp://host:port")
    }

    #[tokio::test]
    async fn discovered_replicas_feed_ingest_and_leaving_frees_the_index() {
        let api = FakeApi::start().await;
        let agent = AgentPublisher::start(EventFormat::Kvroute, true).await;
        let agent_ports = ports(port_of(&agent.events), port_of(agent.replay.as_deref().expect("replay")));
        api.apply(slice("agents-a", "agents", &[("agent-0", "127.0.0.1", true)], agent_ports.clone()));

        let h = Harness::start();
        let fleet = Fleet::new(h.ingest.clone());
        let config = config("agents");
        let discovery = Discovery::start_k8s(
            client(&api),
            &config,
            config.template(MODEL, Some(BLOCK)),
            fleet.clone(),
            DiscoveryMetrics::default(),
            &h.tracker,
            h.shutdown.clone(),
        )
        .unwrap();
        tokio::time::timeout(WAIT, discovery.wait_listed()).await.expect("listed");
        let replica = h.ingest.replicas().by_name("agent-0").expect("discovered replica registered");
        h.synced(&replica).await;

        let tokens = Rng::new(7).tokens(4);
        let published: EventBatch = batch(1, 0, vec![store_chain(&tokens, 0)]);
        agent.publish(published).await;
        wait_until("blocks indexed", || h.index.blocks(replica.id) == 4).await;

        // The pod turns not-Ready (a probe that timed out under load): it is not routed to,
        // and what the index knows of its cache stays; then it is Ready again.
        let serving = || fleet.member("agent-0").expect("still a member").upstream.is_serving();
        api.apply(slice("agents-a", "agents", &[("agent-0", "127.0.0.1", false)], agent_ports.clone()));
        wait_until("not serving", || !serving()).await;
        assert!(Arc::ptr_eq(&fleet.member("agent-0").unwrap().replica, &replica), "the same registration");
        assert_eq!(h.index.blocks(replica.id), 4, "the index kept the replica's blocks");
        // An operator removes and adds it again meanwhile: it comes back not serving.
        let spec = fleet.member("agent-0").unwrap().replica.spec.clone();
        fleet.remove("agent-0").await;
        fleet.add(spec).expect("added again");
        assert!(!serving(), "a replica added under a name that is not serving is not routable");
        let replica = fleet.member("agent-0").unwrap().replica;
        h.synced(&replica).await;
        wait_until("blocks replayed", || h.index.blocks(replica.id) == 4).await;
        api.apply(slice("agents-a", "agents", &[("agent-0", "127.0.0.1", true)], agent_ports.clone()));
        wait_until("serving again", serving).await;
        assert!(Arc::ptr_eq(&fleet.member("agent-0").unwrap().replica, &replica), "the same registration");
        assert_eq!(h.index.blocks(replica.id), 4, "serving again, with its blocks");

        // The pod terminates: the replica leaves ingestion and its blocks leave the index.
        api.apply(slice_terminating(
            "agents-a",
            "agents",
            &[("agent-0", "127.0.0.1", false, true)],
            agent_ports,
        ));
        wait_until("replica removed", || h.ingest.replicas().by_name("agent-0").is_none()).await;
        assert_eq!(h.index.blocks(replica.id), 0);
        assert_eq!(h.index.stats().entries, 0);
    }
}
