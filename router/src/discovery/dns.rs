//! DNS discovery: resolve a headless Service's name periodically; every address is a
//! replica named by its IP, with the configured ports (a dual-stack answer's IPv4 addresses
//! only, if it has any: vLLM listens on IPv4).

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

/// Answers in a row an address must be missing from before its replica is dropped. A
/// headless Service leaves out the pods that are not Ready, which a fleet so loaded that its
/// readiness probes fail looks like for a while too (all of them: no address at all); the
/// replica, and what the index knows of its cache, is kept through that (at the default 5 s
/// interval, 30 s), and dropped after it: the address of a pod that is gone may be handed to
/// another pod.
const MISSING_ANSWERS: u32 = 6;

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

/// The answer's IPv4 addresses if it has any, else all of it: a dual-stack Service answers
/// for each pod twice (A and AAAA), and two replicas for one pod would halve its load as the
/// router sees it and split its cache's credit.
fn one_family(mut answer: Vec<IpAddr>) -> Vec<IpAddr> {
    if answer.iter().any(IpAddr::is_ipv4) {
        answer.retain(IpAddr::is_ipv4);
    }
    answer
}

impl DnsSource {
    /// Resolves every `interval` until `shutdown`; a failed resolution keeps the current set,
    /// an address joins as soon as it is answered, and leaves once [`MISSING_ANSWERS`] answers
    /// in a row have left it out.
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
        // Every address listed, and how many answers in a row have left it out.
        let mut listed: BTreeMap<IpAddr, u32> = BTreeMap::new();
        loop {
            let resolved = tokio::select! {
                () = shutdown.cancelled() => return,
                r = resolve(self.host.clone()) => r,
            };
            match resolved {
                Ok(answer) => {
                    let answer = one_family(answer);
                    listed.retain(|ip, missing| {
                        *missing = if answer.contains(ip) { 0 } else { *missing + 1 };
                        *missing < MISSING_ANSWERS
                    });
                    for ip in answer {
                        listed.entry(ip).or_insert(0);
                    }
                    reconciler.apply(self.desired(listed.keys().copied())).await;
                }
                Err(e) => reconciler.error(&e),
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(self.interval) => {}
            }
        }
    }

    fn desired(&self, ips: impl Iterator<Item = IpAddr>) -> BTreeMap<String, crate::replicas::ReplicaSpec> {
        ips.map(|ip| {
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
                https: false,
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

    /// Scripted answers, lookup `i` at `5 s * i` on the paused clock; returns the set's
    /// names half an interval after each of `lookups` (so every `i` in it must grow).
    async fn sets_after(script: Vec<io::Result<Vec<&'static str>>>, lookups: &[usize]) -> Vec<Vec<String>> {
        let answers = Arc::new(Mutex::new(script.into_iter()));
        let resolve = move |_host: String| {
            let next = answers.lock().unwrap().next();
            async move {
                match next {
                    Some(answer) => answer.map(|ips| ips.iter().map(|ip| ip.parse().unwrap()).collect()),
                    None => Err(io::Error::other("script over")),
                }
            }
        };
        let set = Set(Arc::new(watch::Sender::new(BTreeMap::new())));
        let shutdown = CancellationToken::new();
        let start = tokio::time::Instant::now();
        let reconciler = Reconciler::new(set.clone(), DiscoveryMetrics::default());
        let task = tokio::spawn(source("agents").run(resolve, reconciler, shutdown.clone()));
        let mut sets = Vec::new();
        for &i in lookups {
            tokio::time::sleep_until(start + Duration::from_millis(5000 * i as u64 + 2500)).await;
            sets.push(set.0.borrow().keys().cloned().collect());
        }
        shutdown.cancel();
        task.await.unwrap();
        sets
    }

    /// An address joins at once; one left out of an answer stays until `MISSING_ANSWERS`
    /// answers in a row have left it out (an answer with it starts the count again); a failed
    /// lookup counts for nothing; an empty answer is one that leaves everything out.
    #[tokio::test(start_paused = true)]
    async fn addresses_leave_only_when_left_out_answers_in_a_row() {
        let n = MISSING_ANSWERS as usize;
        let mut script = vec![Ok(vec!["10.0.0.1", "10.0.0.2"])];
        script.extend((1..n).map(|_| Ok(vec!["10.0.0.1"]))); // 2 left out n - 1 times
        script.push(Ok(vec!["10.0.0.1", "10.0.0.2"])); // back: the count starts again
        script.push(Err(io::Error::other("SERVFAIL")));
        script.extend((0..n - 1).map(|_| Ok(vec![]))); // both left out n - 1 times
        script.push(Ok(vec!["10.0.0.3"])); // both left out n times; 3 joins
        let sets = sets_after(script, &[0, n - 1, n, n + 1, 2 * n, 2 * n + 1]).await;
        let names = |ips: &[&str]| ips.iter().map(|ip| ip.to_string()).collect::<Vec<_>>();
        let both = names(&["10.0.0.1", "10.0.0.2"]);
        assert_eq!(sets[0], both, "first answer");
        assert_eq!(sets[1], both, "{} answers without 10.0.0.2 keep it", n - 1);
        assert_eq!(sets[2], both, "back in the answer");
        assert_eq!(sets[3], both, "a failed lookup keeps the set");
        assert_eq!(sets[4], both, "{} empty answers keep it", n - 1);
        assert_eq!(sets[5], names(&["10.0.0.3"]), "{n} in a row drop them; a new address joins at once");
    }

    /// A dual-stack Service answers for each pod with an IPv4 and an IPv6 address: one
    /// replica each, not two (IPv4 when there is any); an IPv6-only answer is kept whole.
    #[tokio::test(start_paused = true)]
    async fn a_dual_stack_answer_gives_one_replica_a_pod() {
        let script = vec![Ok(vec!["10.0.0.5", "fd00::5"]), Ok(vec!["fd00::6"])];
        let sets = sets_after(script, &[0, 1]).await;
        assert_eq!(sets[0], ["10.0.0.5".to_string()]);
        assert!(sets[1].contains(&"fd00::6".to_string()), "{:?}", sets[1]);
    }
}
