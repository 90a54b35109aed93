//! Discovery settings: the `--discovery*` flags (env `KVROUTE_DISCOVERY*`, file keys spelled
//! like the flags). [`DiscoveryConfig`] is meant to be flattened into the router's `Config`
//! (`#[command(flatten)]` + `#[serde(flatten)]`); every flag starts with `discovery` so the
//! flattened names cannot collide.

use std::time::Duration;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use super::{Ports, ReplicaTemplate};
use crate::replicas::EngineKind;

/// Where the router learns its replicas from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoveryMode {
    /// Only the `--replica` list (and the admin API); any other `--discovery-*` setting is
    /// refused, as no discovery would read it.
    #[default]
    Static,
    /// Resolve `--discovery-service` (a headless Service's DNS name) every
    /// `--discovery-interval-ms`; every address is a replica, named by its IP (a
    /// dual-stack answer's IPv4 addresses only, if it has any).
    Dns,
    /// Watch the EndpointSlices of Service `--discovery-service` (needs the `k8s` feature);
    /// every endpoint that is not terminating is a replica, named after its pod, routed to
    /// while it is Ready.
    K8s,
}

/// The `--discovery*` flags.
#[derive(Args, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct DiscoveryConfig {
    /// Where replicas come from besides `--replica`: static, dns or k8s.
    #[arg(long, env = "KVROUTE_DISCOVERY", value_enum, default_value_t = DiscoveryMode::Static)]
    pub discovery: DiscoveryMode,
    /// k8s: the Service whose EndpointSlices list the replicas; dns: the host name to
    /// resolve (e.g. `kvroute-agent.kvroute.svc.cluster.local`).
    #[arg(long, env = "KVROUTE_DISCOVERY_SERVICE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery_service: Option<String>,
    /// k8s: the Service's namespace (default: the router's own).
    #[arg(long, env = "KVROUTE_DISCOVERY_NAMESPACE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery_namespace: Option<String>,
    /// Engine of every discovered replica.
    #[arg(long, env = "KVROUTE_DISCOVERY_ENGINE", value_enum, default_value_t = EngineKind::Kvroute)]
    pub discovery_engine: EngineKind,
    /// Data-parallel ranks of every discovered replica (rank r publishes on port + r).
    #[arg(long, env = "KVROUTE_DISCOVERY_DP_SIZE", default_value_t = 1)]
    pub discovery_dp_size: u32,
    /// ZeroMQ topic prefix of every discovered replica's events (empty: everything).
    #[arg(long, env = "KVROUTE_DISCOVERY_TOPIC", default_value = "")]
    #[serde(default)]
    pub discovery_topic: String,
    /// DNS re-resolution interval, milliseconds; in k8s mode, how often the slices are
    /// applied again (a replica refused while its old entry was being removed is retried).
    #[arg(long, env = "KVROUTE_DISCOVERY_INTERVAL_MS", default_value_t = 5_000)]
    pub discovery_interval_ms: u64,

    /// OpenAI HTTP port (k8s: used when the slice has no port named `--discovery-http-port-name`).
    #[arg(long, env = "KVROUTE_DISCOVERY_HTTP_PORT", default_value_t = 8000)]
    pub discovery_http_port: u16,
    /// ZeroMQ KV-event PUB port of rank 0 (k8s: fallback for the named port). 0: the replicas
    /// publish no KV events, and their caches are predicted from this router's requests
    /// (`--predicted-ttl-ms`; they take no replay or gRPC port, and one rank).
    #[arg(long, env = "KVROUTE_DISCOVERY_EVENTS_PORT", default_value_t = 5557)]
    pub discovery_events_port: u16,
    /// ZeroMQ replay (ROUTER) port of rank 0, if the replicas have one (k8s: fallback).
    #[arg(long, env = "KVROUTE_DISCOVERY_REPLAY_PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery_replay_port: Option<u16>,
    /// gRPC `ReplicaAgent` port (snapshots; kvroute agents only), if any (k8s: fallback).
    #[arg(long, env = "KVROUTE_DISCOVERY_GRPC_PORT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub discovery_grpc_port: Option<u16>,

    /// k8s: name of the EndpointSlice port serving the OpenAI API.
    #[arg(long, env = "KVROUTE_DISCOVERY_HTTP_PORT_NAME", default_value = "http")]
    pub discovery_http_port_name: String,
    /// k8s: name of the port publishing KV events.
    #[arg(long, env = "KVROUTE_DISCOVERY_EVENTS_PORT_NAME", default_value = "kv-events")]
    pub discovery_events_port_name: String,
    /// k8s: name of the KV-event replay port.
    #[arg(long, env = "KVROUTE_DISCOVERY_REPLAY_PORT_NAME", default_value = "kv-replay")]
    pub discovery_replay_port_name: String,
    /// k8s: name of the gRPC `ReplicaAgent` port.
    #[arg(long, env = "KVROUTE_DISCOVERY_GRPC_PORT_NAME", default_value = "grpc")]
    pub discovery_grpc_port_name: String,
    /// k8s: also read each listed pod's `kvroute.io/*` annotations (ports, engine, dp-size,
    /// topic), which win over named ports; needs `get` on pods.
    #[arg(long, env = "KVROUTE_DISCOVERY_POD_ANNOTATIONS", default_value_t = false)]
    #[serde(default)]
    pub discovery_pod_annotations: bool,
    /// Reach discovered replicas' OpenAI API over HTTPS (`https://address:port`): their
    /// certificates are checked as static replicas' are (`--replica-ca-cert`), against
    /// `--replica-tls-server-name`, as they are found by address. The gRPC service and the
    /// event streams stay plain.
    #[arg(long, env = "KVROUTE_DISCOVERY_HTTPS", default_value_t = false)]
    #[serde(default)]
    pub discovery_https: bool,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            discovery: DiscoveryMode::Static,
            discovery_service: None,
            discovery_namespace: None,
            discovery_engine: EngineKind::Kvroute,
            discovery_dp_size: 1,
            discovery_topic: String::new(),
            discovery_interval_ms: 5_000,
            discovery_http_port: 8000,
            discovery_events_port: 5557,
            discovery_replay_port: None,
            discovery_grpc_port: None,
            discovery_http_port_name: "http".into(),
            discovery_events_port_name: "kv-events".into(),
            discovery_replay_port_name: "kv-replay".into(),
            discovery_grpc_port_name: "grpc".into(),
            discovery_pod_annotations: false,
            discovery_https: false,
        }
    }
}

/// EndpointSlice port names of the four endpoints a replica has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortNames {
    pub http: String,
    pub events: String,
    pub replay: String,
    pub grpc: String,
}

impl DiscoveryConfig {
    /// Every problem with the discovery flags, or `Ok`.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        let service_given = self.discovery_service.as_deref().is_some_and(|s| !s.is_empty());
        if self.discovery != DiscoveryMode::Static && !service_given {
            errors.push("--discovery-service is required with --discovery dns|k8s".to_owned());
        }
        if self.discovery == DiscoveryMode::Static {
            let set = self.set_apart_from_the_defaults();
            if !set.is_empty() {
                errors.push(format!(
                    "{} set, but --discovery is static, which reads none of them: set \
                     --discovery dns or k8s, or leave them out",
                    set.join(", ")
                ));
            }
        }
        if self.discovery == DiscoveryMode::K8s && !cfg!(feature = "k8s") {
            errors.push("--discovery k8s needs a router built with the `k8s` feature".to_owned());
        }
        if !(1..=crate::replicas::MAX_DP_SIZE).contains(&self.discovery_dp_size) {
            errors.push(format!("--discovery-dp-size must be 1 to {}", crate::replicas::MAX_DP_SIZE));
        }
        if self.discovery_interval_ms == 0 {
            errors.push("--discovery-interval-ms must be at least 1".to_owned());
        }
        if self.discovery_http_port == 0 {
            errors.push("--discovery-http-port must not be 0".to_owned());
        }
        if self.discovery_events_port == 0
            && (self.discovery_replay_port.is_some()
                || self.discovery_grpc_port.is_some()
                || self.discovery_dp_size > 1
                || !self.discovery_topic.is_empty())
        {
            errors.push(
                "--discovery-events-port 0 (replicas without events) takes no --discovery-replay-port, \
                 --discovery-grpc-port, --discovery-topic, nor --discovery-dp-size above 1"
                    .to_owned(),
            );
        }
        for (flag, port) in [
            ("--discovery-replay-port", self.discovery_replay_port),
            ("--discovery-grpc-port", self.discovery_grpc_port),
        ] {
            if port == Some(0) {
                errors.push(format!("{flag} must not be 0 (leave it out for none)"));
            }
        }
        if self.discovery_namespace.as_deref().is_some_and(|n| n.trim().is_empty()) {
            errors.push(
                "--discovery-namespace must not be empty (leave it out for the router's own)".to_owned(),
            );
        }
        // Rank r listens on the port + r (vLLM's layout).
        let last_rank = self.discovery_dp_size.saturating_sub(1);
        for (flag, port) in [
            ("--discovery-events-port", Some(self.discovery_events_port)),
            ("--discovery-replay-port", self.discovery_replay_port),
        ] {
            if let Some(port) = port.filter(|&p| u32::from(p) + last_rank > u32::from(u16::MAX)) {
                errors.push(format!(
                    "{flag} {port} + --discovery-dp-size {} - 1 is past port 65535",
                    self.discovery_dp_size
                ));
            }
        }
        if let Some(replay) = self.discovery_replay_port
            && self.discovery_events_port != 0
            && u32::from(self.discovery_events_port.abs_diff(replay)) < self.discovery_dp_size.max(1)
        {
            errors.push(format!(
                "--discovery-events-port {} and --discovery-replay-port {replay} overlap over \
                 --discovery-dp-size {} ranks (rank r adds r to both): move the replay port past \
                 the event ports' range",
                self.discovery_events_port, self.discovery_dp_size
            ));
        }
        if errors.is_empty() { Ok(()) } else { Err(errors) }
    }

    /// The `--discovery-*` settings that differ from their defaults (a discovery meant, and
    /// `--discovery` forgotten).
    fn set_apart_from_the_defaults(&self) -> Vec<&'static str> {
        let d = Self::default();
        [
            ("--discovery-service", self.discovery_service.as_deref().is_some_and(|s| !s.is_empty())),
            ("--discovery-namespace", self.discovery_namespace != d.discovery_namespace),
            ("--discovery-engine", self.discovery_engine != d.discovery_engine),
            ("--discovery-dp-size", self.discovery_dp_size != d.discovery_dp_size),
            ("--discovery-topic", self.discovery_topic != d.discovery_topic),
            ("--discovery-interval-ms", self.discovery_interval_ms != d.discovery_interval_ms),
            ("--discovery-http-port", self.discovery_http_port != d.discovery_http_port),
            ("--discovery-events-port", self.discovery_events_port != d.discovery_events_port),
            ("--discovery-replay-port", self.discovery_replay_port != d.discovery_replay_port),
            ("--discovery-grpc-port", self.discovery_grpc_port != d.discovery_grpc_port),
            ("--discovery-http-port-name", self.discovery_http_port_name != d.discovery_http_port_name),
            ("--discovery-events-port-name", self.discovery_events_port_name != d.discovery_events_port_name),
            ("--discovery-replay-port-name", self.discovery_replay_port_name != d.discovery_replay_port_name),
            ("--discovery-grpc-port-name", self.discovery_grpc_port_name != d.discovery_grpc_port_name),
            ("--discovery-pod-annotations", self.discovery_pod_annotations != d.discovery_pod_annotations),
            ("--discovery-https", self.discovery_https != d.discovery_https),
        ]
        .into_iter()
        .filter_map(|(flag, set)| set.then_some(flag))
        .collect()
    }

    pub fn interval(&self) -> Duration {
        Duration::from_millis(self.discovery_interval_ms)
    }

    /// The configured port numbers (DNS mode, and k8s fallbacks for unnamed ports).
    pub fn ports(&self) -> Ports {
        Ports {
            http: self.discovery_http_port,
            events: self.discovery_events_port,
            replay: self.discovery_replay_port,
            grpc: self.discovery_grpc_port,
        }
    }

    pub fn port_names(&self) -> PortNames {
        PortNames {
            http: self.discovery_http_port_name.clone(),
            events: self.discovery_events_port_name.clone(),
            replay: self.discovery_replay_port_name.clone(),
            grpc: self.discovery_grpc_port_name.clone(),
        }
    }

    /// What every discovered replica shares; `model` and `block_size` are the router's.
    pub fn template(&self, model: &str, block_size: Option<u32>) -> ReplicaTemplate {
        ReplicaTemplate {
            engine: self.discovery_engine,
            dp_size: self.discovery_dp_size,
            topic: self.discovery_topic.clone(),
            model: model.to_owned(),
            block_size,
            ports: self.ports(),
            https: self.discovery_https,
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        discovery: DiscoveryConfig,
    }

    #[test]
    fn defaults_match_the_flags() {
        let cli = Cli::parse_from(["r"]);
        assert_eq!(cli.discovery, DiscoveryConfig::default());
        assert_eq!(cli.discovery.validate(), Ok(()));
    }

    /// Regression: a discovery set up but `--discovery` left static was ignored without a word:
    /// the router started with no replica.
    #[test]
    fn discovery_settings_without_a_discovery_are_refused() {
        let forgotten = Cli::parse_from(["r", "--discovery-service", "vllm", "--discovery-https"]).discovery;
        let errors = forgotten.validate().unwrap_err();
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert!(errors[0].starts_with("--discovery-service, --discovery-https set"), "{errors:?}");
        let meant = DiscoveryConfig { discovery: DiscoveryMode::Dns, ..forgotten };
        assert_eq!(meant.validate(), Ok(()));
    }

    #[test]
    fn flags_parse_and_validate() {
        let cli = Cli::parse_from([
            "r",
            "--discovery",
            "dns",
            "--discovery-service",
            "agents.kvroute.svc",
            "--discovery-engine",
            "vllm",
            "--discovery-replay-port",
            "5558",
        ]);
        let d = cli.discovery;
        assert_eq!((d.discovery, d.discovery_engine), (DiscoveryMode::Dns, EngineKind::Vllm));
        assert_eq!(d.ports(), Ports { http: 8000, events: 5557, replay: Some(5558), grpc: None });
        assert_eq!(d.validate(), Ok(()));
        let missing = DiscoveryConfig { discovery: DiscoveryMode::Dns, discovery_dp_size: 0, ..d.clone() };
        let missing = DiscoveryConfig { discovery_service: None, ..missing };
        assert_eq!(missing.validate().unwrap_err().len(), 2);
        // Rank r's ports are the given ones + r: the last rank's must exist.
        let ranks = |dp, events, replay| DiscoveryConfig {
            discovery_dp_size: dp,
            discovery_events_port: events,
            discovery_replay_port: replay,
            ..d.clone()
        };
        assert_eq!(ranks(4, 65532, Some(65520)).validate(), Ok(()));
        assert_eq!(ranks(4, 65533, Some(65520)).validate().unwrap_err().len(), 1);
        // Both ports are offset by the rank: ranges that meet would have two ranks bind one.
        assert_eq!(ranks(1, 5557, Some(5558)).validate(), Ok(()));
        for (events, replay) in [(5557, 5558), (5558, 5557), (5557, 5560), (5557, 5557)] {
            let errors = ranks(4, events, Some(replay)).validate().unwrap_err();
            assert!(errors.len() == 1 && errors[0].contains("overlap"), "{errors:?}");
        }
        assert_eq!(ranks(4, 5557, Some(5561)).validate(), Ok(()));
        // More ranks than a replica may have would have every discovered replica refused.
        assert_eq!(ranks(1024, 5557, None).validate(), Ok(()));
        assert_eq!(ranks(1025, 5557, None).validate().unwrap_err().len(), 1);
        // Ports that can never connect, and a namespace that names none (a blank template value).
        let unusable = DiscoveryConfig {
            discovery_replay_port: Some(0),
            discovery_grpc_port: Some(0),
            discovery_namespace: Some(" ".into()),
            ..d.clone()
        };
        assert_eq!(unusable.validate().unwrap_err().len(), 3);
        // Replicas without events: one rank, nothing to repair from.
        let predicted =
            DiscoveryConfig { discovery_events_port: 0, discovery_replay_port: None, ..d.clone() };
        assert_eq!(predicted.validate(), Ok(()));
        assert_eq!(ranks(2, 0, None).validate().unwrap_err().len(), 1);
        assert_eq!(ranks(1, 0, Some(5558)).validate().unwrap_err().len(), 1);
        let topic = DiscoveryConfig { discovery_topic: "kv".into(), ..predicted };
        assert_eq!(topic.validate().unwrap_err().len(), 1);
    }

    /// How the router's `Config` embeds it: flattened into the layered flags > env > file
    /// parser, whose file keys are the flag names.
    #[derive(Parser, Serialize, Deserialize, Debug)]
    #[serde(rename_all = "kebab-case")]
    struct Layered {
        #[arg(long)]
        #[serde(skip_serializing_if = "Option::is_none")]
        config: Option<std::path::PathBuf>,
        #[command(flatten)]
        #[serde(flatten)]
        discovery: DiscoveryConfig,
    }

    impl kvroute_proto::cli::Layered for Layered {
        fn config_file(&self) -> Option<&std::path::Path> {
            self.config.as_deref()
        }
    }

    #[test]
    fn flattens_into_a_layered_config_file() {
        let path = std::env::temp_dir().join(format!("kvroute-discovery-config-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            "discovery = \"k8s\"\ndiscovery-service = \"vllm\"\ndiscovery-engine = \"vllm\"\n\
             discovery-replay-port = 5558\ndiscovery-pod-annotations = true\ndiscovery-dp-size = 4\n",
        )
        .unwrap();
        let parsed: Result<Layered, _> = kvroute_proto::cli::parse_from([
            "r",
            "--config",
            path.to_str().unwrap(),
            "--discovery-dp-size",
            "2",
        ]);
        std::fs::remove_file(&path).ok();
        let d = parsed.unwrap().discovery;
        assert_eq!(d.discovery, DiscoveryMode::K8s);
        assert_eq!(d.discovery_service.as_deref(), Some("vllm"));
        assert_eq!(d.discovery_engine, EngineKind::Vllm);
        assert_eq!(d.discovery_replay_port, Some(5558));
        assert!(d.discovery_pod_annotations);
        assert_eq!(d.discovery_dp_size, 2, "the flag wins over the file");
    }

    #[test]
    fn round_trips_through_serde() {
        let d = DiscoveryConfig {
            discovery: DiscoveryMode::K8s,
            discovery_service: Some("vllm".into()),
            discovery_engine: EngineKind::Sglang,
            ..DiscoveryConfig::default()
        };
        let value = serde_json::to_value(&d).unwrap();
        assert_eq!(value["discovery"], "k8s");
        assert_eq!(value["discovery-engine"], "sglang");
        assert_eq!(serde_json::from_value::<DiscoveryConfig>(value).unwrap(), d);
    }
}
