//! What a live run reports: latency percentiles (from each request's send, and in an open
//! loop also from its intended send, with how late sends went out), throughput, errors by
//! kind, the realized hit rate (from responses and from the replicas' counters), the
//! router's predicted hit rate (from its headers and its counters), prompt tokens per
//! replica and the load skew.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use super::client::{ErrorKind, Success};
use super::scrape::{ReplicaCounters, RouterCounters, Snapshot};

/// One request of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestRecord {
    /// Index of the request in the workload.
    pub index: usize,
    /// When the open-loop schedule meant to send it, from the start of the run (`None` in a
    /// closed loop, which has no schedule).
    pub intended: Option<Duration>,
    /// When it was sent, from the start of the run.
    pub sent: Duration,
    pub outcome: Result<Success, ErrorKind>,
}

impl RequestRecord {
    /// When it finished (successes only), from the start of the run.
    pub fn done(&self) -> Option<Duration> {
        self.outcome.as_ref().ok().map(|s| self.sent + s.e2e)
    }

    /// How much later than intended it was sent (open loop only; not one never sent).
    pub fn lateness(&self) -> Option<Duration> {
        if self.outcome == Err(ErrorKind::Unsent) {
            return None;
        }
        Some(self.sent.saturating_sub(self.intended?))
    }

    /// `latency` (measured from the send) measured from the intended send instead.
    fn since_intended(&self, latency: Duration) -> Option<Duration> {
        Some(self.lateness()? + latency)
    }
}

/// Nearest-rank percentiles of a latency, in milliseconds, and how many requests they are of.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
    pub max_ms: f64,
}

impl Percentiles {
    /// `None` for no samples.
    pub fn of(mut values: Vec<Duration>) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        values.sort_unstable();
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let at = |p: f64| {
            let rank = ((p / 100.0) * values.len() as f64).ceil() as usize;
            ms(values[rank.clamp(1, values.len()) - 1])
        };
        Some(Self {
            count: values.len(),
            p50_ms: at(50.0),
            p90_ms: at(90.0),
            p99_ms: at(99.0),
            mean_ms: values.iter().map(|&d| ms(d)).sum::<f64>() / values.len() as f64,
            max_ms: ms(values[values.len() - 1]),
        })
    }
}

/// Where a realized hit rate comes from: the two can differ (the responses' `cached_tokens`
/// is what each engine reported per request; the counters are what the replicas counted,
/// with every request in them, including ones whose response was lost).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HitRateSource {
    /// The replicas' prefix-cache counters, every replica's read ([`LiveReport::fleet_hit_rate`]).
    Counters,
    /// The responses' usage ([`LiveReport::hit_rate`]).
    Responses,
}

/// One replica's share of a run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplicaShare {
    /// The replica's base URL (counters) or the router's name for it (headers; an idle
    /// replica the router did not list is `(unnamed replica N)`).
    pub replica: String,
    /// Prompt tokens it received.
    pub prompt_tokens: u64,
    /// Its realized prefix-cache hit rate, when its counters were read.
    pub hit_rate: Option<f64>,
}

/// The outcome of one live run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LiveReport {
    /// What was run (e.g. the routing policy).
    pub label: String,
    pub target: String,
    pub requests: usize,
    pub succeeded: usize,
    /// Failed requests by kind (`http_503`, `connect`, `timeout`, `stream`, ...).
    pub errors: BTreeMap<String, u64>,
    /// From the first send to the last successful answer (a failure's end is not recorded).
    pub duration_s: f64,
    /// Successful requests per second of `duration_s`.
    pub throughput_rps: f64,
    pub output_tokens_per_s: f64,
    /// Time to first token from the actual send: the service's latency, without an
    /// open-loop request's wait for an in-flight slot (see `ttft_from_intended`). Of
    /// successful requests only, as every latency here but `send_lateness`: a failure (a
    /// timeout, at least `--timeout` long) is in `errors`, not in the percentiles, which
    /// under overload look better than the requests fared; `count` says how many they cover.
    pub ttft: Option<Percentiles>,
    pub time_per_output_token: Option<Percentiles>,
    /// End-to-end latency from the actual send (service latency, as `ttft`).
    pub e2e: Option<Percentiles>,
    /// Open loop only: time to first token from when the schedule meant to send the request,
    /// so client-side queueing (a full in-flight limit, a late timer) counts, as it would
    /// for a user arriving then (successful requests only, as `ttft`).
    pub ttft_from_intended: Option<Percentiles>,
    /// Open loop only: end-to-end latency from the intended send (successful requests only).
    pub e2e_from_intended: Option<Percentiles>,
    /// Open loop only: how late requests were sent, against their schedule (every request
    /// sent, failed or not).
    pub send_lateness: Option<Percentiles>,
    pub prompt_tokens: u64,
    /// Sum of `cached_tokens` over the responses that reported it.
    pub cached_tokens: u64,
    /// Sum of `prompt_tokens` over the same responses: `hit_rate`'s denominator.
    pub reported_prompt_tokens: u64,
    /// Successful responses that reported no `cached_tokens`, left out of `hit_rate`.
    pub unreported: usize,
    /// `cached_tokens / reported_prompt_tokens`.
    pub hit_rate: Option<f64>,
    /// Fleet-wide `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` deltas;
    /// `None` unless every replica's counters were read before and after the run (a part of
    /// the fleet is not the fleet).
    pub fleet_hit_rate: Option<f64>,
    /// Replicas given whose counters could not be read both before and after the run, or
    /// whose deltas cannot be right (a counter went backwards: the replica restarted; more
    /// hits than queries): any leaves `fleet_hit_rate` out and the per-replica view to the
    /// router's headers.
    pub replicas_unread: usize,
    /// The router's predicted hit rate from its `x-kvroute-predicted-cached-tokens` headers.
    pub predicted_hit_rate: Option<f64>,
    /// The router's own counters over the run (`None` if it restarted during it).
    pub router: Option<RouterCounters>,
    /// Prompt tokens per replica: the replicas' counters when every replica's were read, else
    /// the router's headers, with every replica the router listed before and after the run and
    /// could route to at its end (or, without its lists, as many as were given) even if no
    /// response named it.
    pub per_replica: Vec<ReplicaShare>,
    /// Max over mean of `per_replica` prompt tokens (1 = even); `None` without a per-replica view.
    /// From the router's headers, of successful requests only (a failed one's replica is not
    /// recorded); from the replicas' counters, of every prompt they took.
    pub load_skew: Option<f64>,
    /// Cumulative realized hit rate by completion time: `(seconds, rate)`.
    pub hit_rate_over_time: Vec<(f64, f64)>,
    /// The run was stopped (Ctrl-C): the requests then in flight failed as `cancelled`, and
    /// those due later were never sent nor counted.
    pub interrupted: bool,
    /// Every request (left out of the JSON).
    #[serde(skip)]
    pub records: Vec<RequestRecord>,
}

/// Points kept in [`LiveReport::hit_rate_over_time`].
const TIMELINE_POINTS: usize = 60;

impl LiveReport {
    /// Aggregates `records` (any order) and the counter snapshots around the run.
    pub fn new(
        label: String,
        target: String,
        mut records: Vec<RequestRecord>,
        replica_urls: &[String],
        before: &Snapshot,
        after: &Snapshot,
    ) -> Self {
        records.sort_by_key(|r| r.index);
        let ok: Vec<&Success> = records.iter().filter_map(|r| r.outcome.as_ref().ok()).collect();
        let mut errors = BTreeMap::new();
        for r in &records {
            if let Err(kind) = r.outcome {
                *errors.entry(kind.label()).or_insert(0) += 1;
            }
        }
        let first = records.iter().map(|r| r.sent).min().unwrap_or_default();
        let last = records.iter().filter_map(RequestRecord::done).max().unwrap_or(first);
        let duration_s = last.saturating_sub(first).as_secs_f64();
        let per_s = |n: f64| if duration_s > 0.0 { n / duration_s } else { 0.0 };

        let reported: Vec<&&Success> = ok.iter().filter(|s| s.cached_tokens.is_some()).collect();
        let reported_prompt: u64 = reported.iter().map(|s| s.prompt_tokens).sum();
        let cached_tokens: u64 = reported.iter().filter_map(|s| s.cached_tokens).sum();
        let predicted: Vec<&&Success> = ok.iter().filter(|s| s.predicted_cached_tokens.is_some()).collect();
        let predicted_prompt: u64 = predicted.iter().map(|s| s.prompt_tokens).sum();
        let predicted_tokens: u64 = predicted.iter().filter_map(|s| s.predicted_cached_tokens).sum();

        let deltas: Vec<(String, ReplicaCounters)> = replica_urls
            .iter()
            .zip(after.replicas.iter().zip(&before.replicas))
            .filter_map(|(url, (a, b))| Some((url.clone(), a.as_ref()?.since(b.as_ref()?)?)))
            .collect();
        // Counters speak for the fleet only when every replica's were read, before and after.
        let every_replica = !deltas.is_empty() && deltas.len() == replica_urls.len();
        let per_replica = if every_replica {
            shares_from_counters(&deltas)
        } else {
            shares_from_headers(&ok, before, after, replica_urls.len())
        };
        let fleet_hit_rate = every_replica
            .then(|| {
                let hits = deltas.iter().map(|(_, d)| d.prefix_cache_hits).sum();
                ratio(hits, deltas.iter().map(|(_, d)| d.prefix_cache_queries).sum())
            })
            .flatten();

        let router = match (&before.router, &after.router) {
            (Some(b), Some(a)) => a.since(b),
            _ => None,
        };
        Self {
            label,
            target,
            requests: records.len(),
            succeeded: ok.len(),
            errors,
            duration_s,
            throughput_rps: per_s(ok.len() as f64),
            output_tokens_per_s: per_s(ok.iter().map(|s| s.completion_tokens as f64).sum()),
            ttft: Percentiles::of(ok.iter().filter_map(|s| s.ttft).collect()),
            time_per_output_token: Percentiles::of(
                ok.iter().filter_map(|s| s.time_per_output_token()).collect(),
            ),
            e2e: Percentiles::of(ok.iter().map(|s| s.e2e).collect()),
            ttft_from_intended: Percentiles::of(
                records.iter().filter_map(|r| r.since_intended(r.outcome.as_ref().ok()?.ttft?)).collect(),
            ),
            e2e_from_intended: Percentiles::of(
                records.iter().filter_map(|r| r.since_intended(r.outcome.as_ref().ok()?.e2e)).collect(),
            ),
            send_lateness: Percentiles::of(records.iter().filter_map(RequestRecord::lateness).collect()),
            prompt_tokens: ok.iter().map(|s| s.prompt_tokens).sum(),
            cached_tokens,
            reported_prompt_tokens: reported_prompt,
            unreported: ok.len() - reported.len(),
            hit_rate: (!reported.is_empty())
                .then(|| ratio(cached_tokens as f64, reported_prompt as f64))
                .flatten(),
            fleet_hit_rate,
            replicas_unread: replica_urls.len() - deltas.len(),
            predicted_hit_rate: (!predicted.is_empty())
                .then(|| ratio(predicted_tokens as f64, predicted_prompt as f64))
                .flatten(),
            router,
            load_skew: skew(&per_replica),
            per_replica,
            hit_rate_over_time: timeline(&records),
            interrupted: false,
            records,
        }
    }

    /// Failed requests.
    pub fn failed(&self) -> u64 {
        self.errors.values().sum()
    }

    /// The best realized hit rate available: the fleet's counters, else the responses'.
    pub fn realized_hit_rate(&self) -> Option<f64> {
        self.realized().map(|(rate, _)| rate)
    }

    /// [`Self::realized_hit_rate`] and where it comes from.
    pub fn realized(&self) -> Option<(f64, HitRateSource)> {
        match (self.fleet_hit_rate, self.hit_rate) {
            (Some(rate), _) => Some((rate, HitRateSource::Counters)),
            (None, Some(rate)) => Some((rate, HitRateSource::Responses)),
            (None, None) => None,
        }
    }
}

/// Each replica's share from its counters' deltas.
fn shares_from_counters(deltas: &[(String, ReplicaCounters)]) -> Vec<ReplicaShare> {
    deltas
        .iter()
        .map(|(url, d)| ReplicaShare {
            replica: url.clone(),
            prompt_tokens: d.prompt_tokens as u64,
            hit_rate: ratio(d.prefix_cache_hits, d.prefix_cache_queries),
        })
        .collect()
}

/// Each replica's share from the router's `x-kvroute-replica` headers. A replica no
/// response named counts at zero (it could have had requests but got none) if the router
/// listed it both before and after the run and, when its page says, could route to it
/// after: one that joined mid-run, or was draining or not serving, is left out. Without the
/// router's lists, replicas given by URL that no response named count as idle, unnamed
/// ones: `replicas` is the fleet's size as far as it is known.
fn shares_from_headers(
    ok: &[&Success],
    before: &Snapshot,
    after: &Snapshot,
    replicas: usize,
) -> Vec<ReplicaShare> {
    let listed = !before.router_replicas.is_empty() && !after.router_replicas.is_empty();
    let mut by_name: BTreeMap<&str, u64> = after
        .router_replicas
        .iter()
        .filter(|name| before.router_replicas.contains(name))
        .filter(|name| after.router_eligible.as_ref().is_none_or(|eligible| eligible.contains(name)))
        .map(|name| (name.as_str(), 0))
        .collect();
    let mut named_any = false;
    for s in ok {
        if let Some(name) = &s.replica {
            *by_name.entry(name).or_insert(0) += s.prompt_tokens;
            named_any = true;
        }
    }
    if !named_any {
        // No response named a replica: there is no per-replica view at all.
        return Vec::new();
    }
    let named = by_name.len();
    let mut shares: Vec<ReplicaShare> = by_name
        .into_iter()
        .map(|(name, tokens)| ReplicaShare { replica: name.into(), prompt_tokens: tokens, hit_rate: None })
        .collect();
    if !listed {
        shares.extend((named..replicas).map(|i| ReplicaShare {
            replica: format!("(unnamed replica {})", i + 1),
            prompt_tokens: 0,
            hit_rate: None,
        }));
    }
    shares
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0).then(|| a / b)
}

/// Max over mean of the replicas' prompt tokens.
pub fn skew(shares: &[ReplicaShare]) -> Option<f64> {
    let max = shares.iter().map(|s| s.prompt_tokens).max()?;
    let mean = shares.iter().map(|s| s.prompt_tokens as f64).sum::<f64>() / shares.len() as f64;
    ratio(max as f64, mean)
}

/// Cumulative `cached / prompt` over responses by completion time, at most
/// [`TIMELINE_POINTS`] evenly spaced points.
fn timeline(records: &[RequestRecord]) -> Vec<(f64, f64)> {
    let mut done: Vec<(Duration, u64, u64)> = records
        .iter()
        .filter_map(|r| {
            let s = r.outcome.as_ref().ok()?;
            Some((r.done()?, s.prompt_tokens, s.cached_tokens?))
        })
        .collect();
    done.sort_unstable_by_key(|d| d.0);
    let Some(&(end, _, _)) = done.last() else { return Vec::new() };
    let step = end.as_secs_f64() / TIMELINE_POINTS as f64;
    let mut out = Vec::with_capacity(TIMELINE_POINTS + 1);
    let (mut prompt, mut cached) = (0u64, 0u64);
    let mut next = step;
    for (i, &(at, p, c)) in done.iter().enumerate() {
        prompt += p;
        cached += c;
        let last = i + 1 == done.len();
        if (at.as_secs_f64() >= next || last) && prompt > 0 {
            out.push((at.as_secs_f64(), cached as f64 / prompt as f64));
            while next <= at.as_secs_f64() {
                next += step.max(1e-9);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(index: usize, sent_ms: u64, prompt: u64, cached: u64, replica: &str) -> RequestRecord {
        RequestRecord {
            index,
            intended: None,
            sent: Duration::from_millis(sent_ms),
            outcome: Ok(Success {
                ttft: Some(Duration::from_millis(10)),
                e2e: Duration::from_millis(100),
                prompt_tokens: prompt,
                completion_tokens: 11,
                cached_tokens: Some(cached),
                usage: true,
                replica: Some(replica.into()),
                predicted_cached_tokens: Some(cached / 2),
            }),
        }
    }

    #[test]
    fn aggregates_rates_skew_and_errors_from_headers() {
        let records = vec![
            ok(0, 0, 100, 0, "a"),
            ok(1, 100, 100, 50, "a"),
            ok(2, 200, 200, 100, "b"),
            RequestRecord {
                index: 3,
                intended: None,
                sent: Duration::ZERO,
                outcome: Err(ErrorKind::Status(503)),
            },
            RequestRecord {
                index: 4,
                intended: None,
                sent: Duration::ZERO,
                outcome: Err(ErrorKind::Connect),
            },
        ];
        let none = Snapshot::default();
        let r = LiveReport::new("x".into(), "t".into(), records, &[], &none, &none);
        assert_eq!((r.requests, r.succeeded, r.failed()), (5, 3, 2));
        assert_eq!(r.errors.get("http_503"), Some(&1));
        assert_eq!(r.errors.get("connect"), Some(&1));
        assert_eq!(r.hit_rate, Some(150.0 / 400.0));
        assert_eq!(r.predicted_hit_rate, Some(75.0 / 400.0));
        assert_eq!(r.load_skew, Some(1.0));
        assert!((r.duration_s - 0.3).abs() < 1e-9);
        assert_eq!(r.ttft.unwrap().p50_ms, 10.0);
        assert_eq!((r.ttft.unwrap().count, r.e2e.unwrap().count), (3, 3), "the successes' latencies alone");
        assert_eq!(r.time_per_output_token.unwrap().p50_ms, 9.0);
        let last = r.hit_rate_over_time.last().unwrap();
        assert!((last.1 - 150.0 / 400.0).abs() < 1e-12);
    }

    fn counters(hits: f64, queries: f64, prompt: f64) -> Option<ReplicaCounters> {
        Some(ReplicaCounters {
            prefix_cache_hits: hits,
            prefix_cache_queries: queries,
            prompt_tokens: prompt,
            started: None,
        })
    }

    #[test]
    fn idle_replicas_count_in_the_skew_from_headers() {
        // Four replicas behind the router, all traffic on two of them, evenly.
        let records = vec![ok(0, 0, 100, 0, "a"), ok(1, 10, 100, 0, "b")];
        let listed = Snapshot {
            router_replicas: ["a", "b", "c", "d"].map(String::from).into(),
            ..Snapshot::default()
        };
        let r = LiveReport::new("x".into(), "t".into(), records.clone(), &[], &listed, &listed);
        let names: Vec<&str> = r.per_replica.iter().map(|s| s.replica.as_str()).collect();
        assert_eq!(names, ["a", "b", "c", "d"]);
        assert_eq!(r.load_skew, Some(2.0));
        // Without the router's list, the replicas given by URL say how many there are.
        let urls: Vec<String> = (0..4).map(|i| format!("http://r{i}")).collect();
        let unread = Snapshot { replicas: vec![None; 4], ..Snapshot::default() };
        let r = LiveReport::new("x".into(), "t".into(), records, &urls, &unread, &unread);
        assert_eq!(r.per_replica.len(), 4);
        assert_eq!(r.load_skew, Some(2.0));
    }

    /// Regression: the skew from headers counted every replica the router listed before or
    /// after the run as idle, with those it could not route to (draining, not serving) and
    /// one that joined after the run began.
    #[test]
    fn replicas_the_router_could_not_route_to_are_not_idle_in_the_skew() {
        let records = vec![ok(0, 0, 100, 0, "a"), ok(1, 10, 100, 0, "b")];
        let names = |list: &[&str]| list.iter().map(|&n| n.to_string()).collect::<Vec<_>>();
        let before = Snapshot { router_replicas: names(&["a", "b", "c", "d"]), ..Snapshot::default() };
        let after = Snapshot {
            router_replicas: names(&["a", "b", "c", "d", "e"]),
            router_eligible: Some(names(&["a", "b", "c", "e"])),
            ..Snapshot::default()
        };
        // Four replicas given by URL: the router's lists say which count, not their number.
        let urls: Vec<String> = (0..4).map(|i| format!("http://r{i}")).collect();
        let r = LiveReport::new("x".into(), "t".into(), records, &urls, &before, &after);
        let shares: Vec<&str> = r.per_replica.iter().map(|s| s.replica.as_str()).collect();
        assert_eq!(shares, ["a", "b", "c"]);
        assert_eq!(r.load_skew, Some(1.5));
    }

    #[test]
    fn a_partial_scrape_is_no_fleet_hit_rate() {
        let urls = vec!["http://r0".to_string(), "http://r1".to_string()];
        let records = vec![ok(0, 0, 100, 80, "r0"), ok(1, 10, 100, 0, "r1")];
        let before = Snapshot { replicas: vec![counters(0.0, 0.0, 0.0), None], ..Snapshot::default() };
        let after = Snapshot {
            replicas: vec![counters(80.0, 100.0, 100.0), counters(0.0, 100.0, 100.0)],
            ..Snapshot::default()
        };
        let r = LiveReport::new("x".into(), "t".into(), records.clone(), &urls, &before, &after);
        assert_eq!((r.fleet_hit_rate, r.replicas_unread), (None, 1));
        // The per-replica view falls back to the headers, both replicas in it.
        assert_eq!(r.per_replica.len(), 2);
        assert_eq!(r.per_replica[0].hit_rate, None);
        // Read in full, the counters are the fleet's.
        let before = Snapshot { replicas: vec![counters(0.0, 0.0, 0.0); 2], ..Snapshot::default() };
        let r = LiveReport::new("x".into(), "t".into(), records, &urls, &before, &after);
        assert_eq!((r.fleet_hit_rate, r.replicas_unread), (Some(80.0 / 200.0), 0));
        assert_eq!(r.per_replica[0].replica, "http://r0");
    }

    /// Regression: a replica restarted mid-run (its hits reset, its queries back where they
    /// were) put 800 hits over 0 queries into the fleet's hit rate, which went past 100%.
    #[test]
    fn a_replica_restarted_mid_run_is_unread() {
        let urls = vec!["http://r0".to_string(), "http://r1".to_string()];
        let records = vec![ok(0, 0, 100, 80, "r0"), ok(1, 10, 100, 0, "r1")];
        let before = Snapshot {
            replicas: vec![counters(0.0, 0.0, 0.0), counters(0.0, 1000.0, 1000.0)],
            ..Snapshot::default()
        };
        let after = Snapshot {
            replicas: vec![counters(80.0, 100.0, 100.0), counters(800.0, 1000.0, 1000.0)],
            ..Snapshot::default()
        };
        let r = LiveReport::new("x".into(), "t".into(), records, &urls, &before, &after);
        assert_eq!((r.fleet_hit_rate, r.replicas_unread), (None, 1));
        assert_eq!(r.realized_hit_rate(), Some(80.0 / 200.0));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let p = Percentiles::of((1..=100).map(Duration::from_millis).collect()).unwrap();
        assert_eq!((p.p50_ms, p.p90_ms, p.p99_ms, p.max_ms), (50.0, 90.0, 99.0, 100.0));
        assert_eq!(Percentiles::of(vec![]), None);
    }
}
