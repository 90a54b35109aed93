//! DNS discovery: resolve a headless Service's name periodically; every address is a
//! replica named by its IP, with the configured ports.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::time::Duration;

use dns_lookup::{AddrInfoHints, LookupErrorKind, SockType};
use tokio_util::sync::CancellationToken;

use super::{Reconciler, ReplicaSink, ReplicaTemplate};

/// What the DNS source resolves and how often.
#[derive(Clone, Debug)]
pub(super) struct DnsSource {
    pub host: String,
    pub template: ReplicaTemplate,
    pub interval: Duration,
}

/// The system resolver (`getaddrinfo` on a blocking thread). A name that does not exist or
/// has no addresses (NXDOMAIN, NODATA: a headless Service with no ready endpoint) is an
/// answer, and it is empty; only a failure to get an answer (a timeout, SERVFAIL) is an error.
pub(super) async fn system_resolver(host: String) -> io::Result<Vec<IpAddr>> {
    tokio::task::spawn_blocking(move || {
        let hints = AddrInfoHints { socktype: SockType::Stream.into(), ..AddrInfoHints::default() };
        match dns_lookup::getaddrinfo(Some(&host), None, Some(hints)) {
            Ok(addresses) => addresses.map(|a| a.map(|a| a.sockaddr.ip())).collect(),
            Err(e) if matches!(e.kind(), LookupErrorKind::NoName | LookupErrorKind::NoData) => Ok(Vec::new()),
            Err(e) => Err(e.into()),
        }
    })
    .await
    .map_err(io::Error::other)?
}

impl DnsSource {
    /// Resolves every `interval` until `shutdown`; a failed resolution keeps the current set,
    /// an empty answer empties it.
    pub(super) async fn run<S, R, F>(
        self,
        resolve: R,
        mut reconciler: Reconciler<S>,
        shutdown: CancellationToken,
    ) where
        S: ReplicaSink,
        R: Fn(String) -> F + Send,
        F: Future<Output = io::Result<Vec<IpAddr>>> + Send,
    {
        loop {
            let resolved = tokio::select! {
                () = shutdown.cancelled() => return,
                r = resolve(self.host.clone()) => r,
            };
            match resolved {
                Ok(ips) => reconciler.apply(self.desired(ips)).await,
                Err(e) => reconciler.error(&e),
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }

    fn desired(&self, ips: Vec<IpAddr>) -> BTreeMap<String, crate::replicas::ReplicaSpec> {
        ips.into_iter()
            .map(|ip| {
                let name = ip.to_string();
                let spec = self.template.spec(name.clone(), &name, self.template.ports);
                (name, spec)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use tokio::sync::watch;

    use super::*;
    use crate::discovery::{DiscoveryMetrics, Ports};
    use crate::replicas::{EngineKind, ReplicaSpec};

    /// A sink whose replica set can be awaited.
    #[derive(Clone)]
    struct Set(Arc<watch::Sender<BTreeMap<String, ReplicaSpec>>>);

    impl ReplicaSink for Set {
        type Error = std::convert::Infallible;
        async fn upsert(&self, spec: ReplicaSpec) -> Result<(), Self::Error> {
            self.0.send_modify(|s| drop(s.insert(spec.name.clone(), spec)));
            Ok(())
        }
        async fn remove(&self, name: &str) {
            self.0.send_modify(|s| drop(s.remove(name)));
        }
    }

    fn source(host: &str) -> DnsSource {
        DnsSource {
            host: host.into(),
            template: ReplicaTemplate {
                engine: EngineKind::Kvroute,
                dp_size: 1,
                topic: String::new(),
                model: "m".into(),
                block_size: None,
                ports: Ports { http: 8000, events: 5557, replay: Some(5558), grpc: Some(50051) },
            },
            interval: Duration::from_secs(5),
        }
    }

    #[tokio::test]
    async fn localhost_resolves_to_loopback_replicas() {
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())));
        let mut rx = set.0.subscribe();
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(source("localhost").run(
            system_resolver,
            Reconciler::new(set.clone(), DiscoveryMetrics::default()),
            shutdown.clone(),
        ));
        let replicas = rx.wait_for(|s| !s.is_empty()).await.unwrap().clone();
        shutdown.cancel();
        task.await.unwrap();
        assert!(replicas.keys().all(|n| n.parse::<IpAddr>().unwrap().is_loopback()), "{replicas:?}");
        if let Some(spec) = replicas.get("127.0.0.1") {
            assert_eq!(spec.http_url, "http://127.0.0.1:8000");
            assert_eq!(spec.event_endpoint, "tcp://127.0.0.1:5557");
            assert_eq!(spec.replay_endpoint.as_deref(), Some("tcp://127.0.0.1:5558"));
            assert_eq!(spec.grpc_endpoint.as_deref(), Some("http://127.0.0.1:50051"));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn answers_change_the_set_and_failures_keep_it() {
        let answers: Arc<Mutex<Vec<io::Result<Vec<IpAddr>>>>> = Arc::new(Mutex::new(vec![
            Ok(vec!["10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()]),
            Err(io::Error::other("SERVFAIL")),
            Ok(vec!["10.0.0.2".parse().unwrap()]),
        ]));
        let resolve = {
            let answers = answers.clone();
            move |_host: String| {
                let mut answers = answers.lock().unwrap();
                let next = (!answers.is_empty()).then(|| answers.remove(0));
                async move { next.unwrap_or_else(|| Ok(vec!["10.0.0.3".parse().unwrap()])) }
            }
        };
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())));
        let mut rx = set.0.subscribe();
        let shutdown = CancellationToken::new();
        let reconciler = Reconciler::new(set.clone(), DiscoveryMetrics::default());
        let metrics = reconciler.metrics.clone();
        let task = tokio::spawn(source("agents").run(resolve, reconciler, shutdown.clone()));
        let names = |s: &BTreeMap<String, ReplicaSpec>| s.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&rx.wait_for(|s| s.len() == 2).await.unwrap()), ["10.0.0.1", "10.0.0.2"]);
        // The failure in between kept both; the third answer drops 10.0.0.1.
        assert_eq!(names(&rx.wait_for(|s| s.len() == 1).await.unwrap()), ["10.0.0.2"]);
        assert_eq!(metrics.errors.get(), 1);
        assert_eq!(names(&rx.wait_for(|s| s.contains_key("10.0.0.3")).await.unwrap()), ["10.0.0.3"]);
        shutdown.cancel();
        task.await.unwrap();
    }

    /// A name that does not exist is an empty answer, not a failure: the set empties (a
    /// fleet whose pods are all gone must not keep their addresses, which the cluster may give
    /// to other pods).
    #[tokio::test]
    async fn a_name_that_does_not_exist_empties_the_set() {
        assert_eq!(system_resolver("no-such-replica.invalid".into()).await.unwrap(), Vec::<IpAddr>::new());
        let answers = Arc::new(Mutex::new(vec![Ok(vec!["10.0.0.1".parse().unwrap()])]));
        let resolve = move |host: String| {
            let next = answers.lock().unwrap().pop();
            async move {
                match next {
                    Some(answer) => answer,
                    None => system_resolver(format!("{host}.invalid")).await,
                }
            }
        };
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())));
        let mut rx = set.0.subscribe();
        let shutdown = CancellationToken::new();
        let mut source = source("agents");
        source.interval = Duration::from_millis(1);
        let task = tokio::spawn(source.run(
            resolve,
            Reconciler::new(set.clone(), DiscoveryMetrics::default()),
            shutdown.clone(),
        ));
        rx.wait_for(|s| s.len() == 1).await.unwrap();
        tokio::time::timeout(Duration::from_secs(30), rx.wait_for(BTreeMap::is_empty))
            .await
            .unwrap()
            .unwrap();
        shutdown.cancel();
        task.await.unwrap();
    }
}
