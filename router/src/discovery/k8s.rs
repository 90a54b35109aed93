//! Kubernetes discovery: watch a Service's EndpointSlices and turn every Ready endpoint into
//! a replica (see the parent module for the rules).
//!
//! The watcher lists, then watches from the list's resourceVersion. Its events are folded
//! into a map slice name → replicas: `Init` … `InitApply` … `InitDone` (a first list, or a
//! re-list after `410 Gone`) replace the whole map at `InitDone`, so slices deleted while
//! the watch was down disappear too; `Apply` / `Delete` replace or drop one slice. After
//! every change the union over slices (first slice by name wins if a pod is in two, as
//! happens briefly while the controller moves it) goes to the [`Reconciler`]. Watch errors
//! are counted and retried with kube's default backoff (0.8 s doubling to 30 s).

use std::collections::BTreeMap;
use std::pin::pin;

use futures::StreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use tokio_util::sync::CancellationToken;

use super::{PortNames, Ports, Reconciler, ReplicaSink, ReplicaTemplate};
use crate::replicas::ReplicaSpec;

/// The label the EndpointSlice controller puts on every slice of a Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Which Service to follow and how to read its slices.
#[derive(Clone, Debug)]
pub struct SliceSource {
    pub service: String,
    pub template: ReplicaTemplate,
    pub port_names: PortNames,
}

type Slices = BTreeMap<String, Vec<ReplicaSpec>>;

impl SliceSource {
    /// Follows the slices until `shutdown`.
    pub async fn run<S: ReplicaSink>(
        self,
        api: Api<EndpointSlice>,
        mut reconciler: Reconciler<S>,
        shutdown: CancellationToken,
    ) {
        let config = watcher::Config::default().labels(&format!("{SERVICE_NAME_LABEL}={}", self.service));
        let mut events = pin!(watcher(api, config).default_backoff());
        let mut slices = Slices::new();
        // Slices of a listing in progress (between `Init` and `InitDone`).
        let mut listing: Option<Slices> = None;
        loop {
            let event = tokio::select! {
                () = shutdown.cancelled() => return,
                event = events.next() => event,
            };
            let Some(event) = event else { return };
            match event {
                Ok(watcher::Event::Init) => listing = Some(Slices::new()),
                Ok(watcher::Event::InitApply(slice)) => {
                    listing.get_or_insert_default().insert(slice_name(&slice), self.replicas(&slice));
                }
                Ok(watcher::Event::InitDone) => {
                    slices = listing.take().unwrap_or_default();
                    reconciler.apply(union(&slices)).await;
                }
                Ok(watcher::Event::Apply(slice)) => {
                    slices.insert(slice_name(&slice), self.replicas(&slice));
                    reconciler.apply(union(&slices)).await;
                }
                Ok(watcher::Event::Delete(slice)) => {
                    slices.remove(&slice_name(&slice));
                    reconciler.apply(union(&slices)).await;
                }
                Err(e) => reconciler.error(&e),
            }
        }
    }

    /// The Ready endpoints of one slice as replicas.
    pub fn replicas(&self, slice: &EndpointSlice) -> Vec<ReplicaSpec> {
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
            // The API says a missing `ready` means ready; terminating pods are never ready.
            .filter(|ep| ep.conditions.as_ref().and_then(|c| c.ready) != Some(false))
            .filter_map(|ep| {
                let address = ep.addresses.first()?;
                let pod = ep.target_ref.as_ref().filter(|r| r.kind.as_deref() == Some("Pod"));
                let name = pod.and_then(|r| r.name.clone()).unwrap_or_else(|| address.clone());
                Some(self.template.spec(name, address, ports))
            })
            .collect()
    }
}

fn slice_name(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

fn union(slices: &Slices) -> BTreeMap<String, ReplicaSpec> {
    let mut all = BTreeMap::new();
    for spec in slices.values().flatten() {
        all.entry(spec.name.clone()).or_insert_with(|| spec.clone());
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

    #[test]
    fn ready_endpoints_with_named_ports_become_replicas() {
        let config = DiscoveryConfig::default();
        let source = SliceSource {
            service: "agents".into(),
            template: config.template("m", Some(16)),
            port_names: config.port_names(),
        };
        let s = slice(serde_json::json!({
            "metadata": {"name": "agents-x"},
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true},
                 "targetRef": {"kind": "Pod", "name": "agent-0"}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": false, "terminating": true},
                 "targetRef": {"kind": "Pod", "name": "agent-1"}},
                {"addresses": ["10.0.0.3"]},
            ],
            "ports": [
                {"name": "http", "port": 9000},
                {"name": "kv-events", "port": 6000},
                {"name": "grpc", "port": 50051},
            ],
        }));
        let replicas = source.replicas(&s);
        let names: Vec<_> = replicas.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["agent-0", "10.0.0.3"]);
        let r = &replicas[0];
        assert_eq!(r.http_url, "http://10.0.0.1:9000");
        assert_eq!(r.event_endpoint, "tcp://10.0.0.1:6000");
        assert_eq!(r.replay_endpoint, None, "no kv-replay port and no default");
        assert_eq!(r.grpc_endpoint.as_deref(), Some("http://10.0.0.1:50051"));
    }

    #[test]
    fn unnamed_ports_fall_back_to_the_configured_numbers() {
        let config = DiscoveryConfig { discovery_replay_port: Some(5558), ..DiscoveryConfig::default() };
        let source = SliceSource {
            service: "vllm".into(),
            template: config.template("m", None),
            port_names: config.port_names(),
        };
        let s = slice(serde_json::json!({
            "metadata": {"name": "vllm-x"},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "vllm-0"}}],
            "ports": [{"name": "openai", "port": 8000}],
        }));
        let r = &source.replicas(&s)[0];
        assert_eq!(r.http_url, "http://10.0.0.1:8000");
        assert_eq!(r.event_endpoint, "tcp://10.0.0.1:5557");
        assert_eq!(r.replay_endpoint.as_deref(), Some("tcp://10.0.0.1:5558"));
    }
}
