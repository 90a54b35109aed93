//! DNS discovery: resolve a headless Service's name periodically; every address is a
//! replica named by its IP, with the configured ports.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::time::Duration;

use dns_lookup::{AddrInfo, AddrInfoHints, LookupError, LookupErrorKind, SockType};
use tokio_util::sync::CancellationToken;

use super::{Reconciler, ReplicaSink, ReplicaTemplate};

/// What the DNS source resolves and how often.
#[derive(Clone, Debug)]
pub(super) struct DnsSource {
    pub host: String,
    pub template: ReplicaTemplate,
    pub interval: Duration,
}

/// Empty answers in a row that empty the set. A headless Service answers with no address
/// when none of its pods is Ready, which a fleet so overloaded that every readiness probe
/// fails looks like for a while too; the set (and what the index knows) is kept through that
/// (at the default 5 s interval, 30 s), and dropped after it: the addresses of pods that are
/// gone may be handed to other pods.
const EMPTY_ANSWERS: u32 = 6;

/// The system resolver (`getaddrinfo` on a blocking thread).
pub(super) async fn system_resolver(host: String) -> io::Result<Vec<IpAddr>> {
    tokio::task::spawn_blocking(move || {
        let hints = AddrInfoHints { socktype: SockType::Stream.into(), ..AddrInfoHints::default() };
        addresses(dns_lookup::getaddrinfo(Some(&host), None, Some(hints)).map(|found| found.collect()))
    })
    .await
    .map_err(io::Error::other)?
}

/// A lookup's addresses. A name that does not exist or has no addresses (NXDOMAIN, NODATA)
/// is an answer, and it is empty; only a failure to get an answer (a timeout, SERVFAIL) is
/// an error.
fn addresses(found: Result<Vec<io::Result<AddrInfo>>, LookupError>) -> io::Result<Vec<IpAddr>> {
    match found {
        Ok(addresses) => addresses.into_iter().map(|a| a.map(|a| a.sockaddr.ip())).collect(),
        Err(e) if matches!(e.kind(), LookupErrorKind::NoName | LookupErrorKind::NoData) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    }
}

impl DnsSource {
    /// Resolves every `interval` until `shutdown`; a failed resolution keeps the current set,
    /// and so do empty answers until [`EMPTY_ANSWERS`] of them in a row.
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
        let mut empty_answers = 0;
        loop {
            let resolved = tokio::select! {
                () = shutdown.cancelled() => return,
                r = resolve(self.host.clone()) => r,
            };
            match resolved {
                Ok(ips) if ips.is_empty() && empty_answers + 1 < EMPTY_ANSWERS => {
                    empty_answers += 1;
                    tracing::info!(host = %self.host, empty_answers, "discovery: no addresses; keeping the replicas for now");
                }
                Ok(ips) => {
                    empty_answers = if ips.is_empty() { EMPTY_ANSWERS } else { 0 };
                    reconciler.apply(self.desired(ips)).await;
                }
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

    /// A name that does not exist or has no addresses is an empty answer; a failure to get
    /// an answer is an error.
    #[test]
    fn no_such_name_is_an_empty_answer() {
        for code in [libc::EAI_NONAME, libc::EAI_NODATA] {
            assert_eq!(addresses(Err(LookupError::new(code))).unwrap(), Vec::<IpAddr>::new(), "{code}");
        }
        for code in [libc::EAI_AGAIN, libc::EAI_FAIL] {
            assert!(addresses(Err(LookupError::new(code))).is_err(), "{code}");
        }
    }

    /// Empty answers keep the set until `EMPTY_ANSWERS` of them in a row; an answer with
    /// addresses in between starts the count again. (Paused clock: lookup `i` happens at
    /// `5 s * i`; the set is read half an interval after a lookup.)
    #[tokio::test(start_paused = true)]
    async fn empty_answers_empty_the_set_only_in_a_row() {
        let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
        let n = EMPTY_ANSWERS as usize;
        let mut script: Vec<Vec<IpAddr>> = vec![vec![ip("10.0.0.1")]];
        script.extend(std::iter::repeat_n(Vec::new(), n - 1));
        script.push(vec![ip("10.0.0.2")]);
        script.extend(std::iter::repeat_n(Vec::new(), n));
        let answers = Arc::new(Mutex::new(script.into_iter()));
        let resolve = move |_host: String| {
            let next = answers.lock().unwrap().next().unwrap_or_default();
            async move { Ok(next) }
        };
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())));
        let shutdown = CancellationToken::new();
        let start = tokio::time::Instant::now();
        let task = tokio::spawn(source("agents").run(
            resolve,
            Reconciler::new(set.clone(), DiscoveryMetrics::default()),
            shutdown.clone(),
        ));
        let after_lookup = async |i: usize| {
            tokio::time::sleep_until(start + Duration::from_millis(5000 * i as u64 + 2500)).await;
            set.0.borrow().keys().cloned().collect::<Vec<_>>()
        };
        assert_eq!(after_lookup(n - 1).await, ["10.0.0.1"], "{} empty answers keep the set", n - 1);
        assert_eq!(after_lookup(n).await, ["10.0.0.2"]);
        assert_eq!(after_lookup(2 * n - 1).await, ["10.0.0.2"], "the count started again");
        assert_eq!(after_lookup(2 * n).await, Vec::<String>::new(), "{n} in a row empty it");
        shutdown.cancel();
        task.await.unwrap();
    }
}
