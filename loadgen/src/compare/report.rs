//! The compare report: one row per routing policy beside the pooled reference, as a terminal
//! table ([`CompareReport::table`]) and as JSON (serde; per-request records left out). The
//! table's TTFT is from each request's actual send (the service's latency); an open-loop
//! run's TTFT from its intended send follows the table.

use std::fmt::Write as _;

use kvroute_replica_agent::cache;
use kvroute_router::policy::PolicyKind;
use serde::Serialize;

use crate::live::{HitRateSource, LiveReport, PromptFormat};
use crate::workload::Trace;

/// Everything one `compare` measured.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CompareReport {
    pub workload: WorkloadSummary,
    pub fleet: FleetSummary,
    /// Hit rate of one cache of the fleet's total capacity on the whole workload (a run that
    /// stopped early has its own, on the requests it served).
    pub pooled_hit_rate: f64,
    pub runs: Vec<PolicyRun>,
}

/// What was sent.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkloadSummary {
    pub name: String,
    pub requests: usize,
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// From the first to the last arrival in the trace.
    pub trace_duration_s: f64,
    /// How the prompts were written.
    pub prompt_format: PromptFormat,
}

impl WorkloadSummary {
    pub fn of(name: &str, trace: &Trace, prompt_format: PromptFormat) -> Self {
        Self {
            name: name.into(),
            requests: trace.len(),
            prompt_tokens: trace.prompt_tokens(),
            output_tokens: trace.requests.iter().map(|r| u64::from(r.output_len)).sum(),
            trace_duration_s: trace.duration().as_secs_f64(),
            prompt_format,
        }
    }
}

/// The fleet the runs went to.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FleetSummary {
    pub replicas: usize,
    /// Engines behind them, a cache each (more than the replicas when they are data-parallel).
    pub engines: usize,
    pub total_capacity_blocks: usize,
    /// Blocks of host memory in all (the agents' `--offload-blocks`): a prefix loaded from
    /// there is a hit, so the pooled reference's one cache holds these too.
    pub offload_capacity_blocks: usize,
    pub block_size: usize,
    /// The eviction policy the pooled reference and the offline runs used.
    pub eviction: cache::PolicyKind,
    /// Its settings, with S3FIFO.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s3fifo: Option<cache::S3FifoParams>,
    /// The agents' `--time-scale`: every latency they simulate is divided by it, so the live
    /// TTFT and requests/s are in that sped-up time (1 for real engines).
    pub time_scale: f64,
}

/// One policy's run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyRun {
    pub policy: PolicyKind,
    /// The requests the pooled reference and the offline simulation replayed: those this
    /// run served (sent, and not cancelled in flight); fewer than the workload's if it
    /// stopped early.
    pub compared_requests: usize,
    /// The pooled reference's hit rate on those requests.
    pub pooled_hit_rate: f64,
    /// Where the realized hit rate of this run comes from: the replicas' counters when every
    /// replica's were read, else the responses' usage.
    pub hit_rate_source: Option<HitRateSource>,
    /// Realized hit rate (as `hit_rate_source` says) as a percentage of `pooled_hit_rate`;
    /// above 100 when separate caches beat the pooled one.
    pub pct_of_pooled: Option<f64>,
    pub live: LiveReport,
    /// The offline simulator on the same requests, if asked for.
    pub offline: Option<OfflineRun>,
}

/// One policy simulated offline ([`crate::sim`]) on the requests the live run served.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct OfflineRun {
    pub hit_rate: f64,
    pub load_skew: f64,
    pub pct_of_pooled: Option<f64>,
    /// Simulated, unscaled time to first token.
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
}

impl PolicyRun {
    pub fn new(
        policy: PolicyKind,
        live: LiveReport,
        compared_requests: usize,
        pooled_hit_rate: f64,
        offline: Option<OfflineRun>,
    ) -> Self {
        let realized = live.realized();
        let pct_of_pooled =
            realized.filter(|_| pooled_hit_rate > 0.0).map(|(rate, _)| 100.0 * rate / pooled_hit_rate);
        Self {
            policy,
            compared_requests,
            pooled_hit_rate,
            hit_rate_source: realized.map(|(_, source)| source),
            pct_of_pooled,
            live,
            offline,
        }
    }
}

impl CompareReport {
    /// The policies whose runs sent requests and had every one fail: nothing was compared,
    /// whatever the table shows.
    pub fn served_nothing(&self) -> Vec<PolicyKind> {
        let nothing = |run: &&PolicyRun| run.live.requests > 0 && run.live.succeeded == 0;
        self.runs.iter().filter(nothing).map(|run| run.policy).collect()
    }

    /// The run of `policy`, if it was compared.
    pub fn run(&self, policy: PolicyKind) -> Option<&PolicyRun> {
        self.runs.iter().find(|r| r.policy == policy)
    }

    /// The report as a terminal table, one row per policy.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let w = &self.workload;
        let f = &self.fleet;
        let _ = writeln!(
            out,
            "workload {}: {} requests, {} prompt tokens{}, {} output tokens over {:.0} s of trace",
            w.name,
            w.requests,
            w.prompt_tokens,
            match w.prompt_format {
                PromptFormat::Ids => "",
                PromptFormat::Text => " (as text)",
                PromptFormat::Messages => " (as text, Anthropic Messages requests)",
                PromptFormat::Responses => " (as text, OpenAI Responses requests)",
                PromptFormat::Generate => " (SGLang's /generate requests)",
            },
            w.output_tokens,
            w.trace_duration_s
        );
        let engines = match f.engines == f.replicas {
            true => String::new(),
            false => format!(" ({} engines)", f.engines),
        };
        let mut eviction = clap::ValueEnum::to_possible_value(&f.eviction)
            .map_or_else(String::new, |v| v.get_name().to_owned());
        if let Some(p) = f.s3fifo {
            let _ = write!(eviction, " (small queue {}, max freq {})", p.small_ratio, p.max_freq);
        }
        let host = match f.offload_capacity_blocks {
            0 => String::new(),
            blocks => format!(" and {blocks} of host memory"),
        };
        let _ = writeln!(
            out,
            "fleet: {} replicas{engines}, {} blocks in total{host}, block size {}; pooled reference (one {eviction} cache of {} blocks; separate caches can beat it): {:.1}% hit rate",
            f.replicas,
            f.total_capacity_blocks,
            f.block_size,
            f.total_capacity_blocks + f.offload_capacity_blocks,
            100.0 * self.pooled_hit_rate
        );
        if f.time_scale != 1.0 {
            let _ = writeln!(
                out,
                "time scale {}: the agents run that much faster than the engine they model, and TTFT and req/s are \
                 as measured, in that sped-up time",
                f.time_scale
            );
        }
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<14} {:>9} {:>9} {:>8} {:>15} {:>15} {:>9} {:>6} {:>7}   {:>9} {:>8} {:>6}",
            "policy",
            "hit rate",
            "predicted",
            "% pooled",
            "TTFT p50 (send)",
            "TTFT p99 (send)",
            "req/s",
            "skew",
            "errors",
            "offline:",
            "hit rate",
            "skew"
        );
        // A hit rate from the responses, not the counters, is marked `*` (and so is the
        // `% pooled` made of it), with a footnote.
        let mark = |run: &PolicyRun| match run.hit_rate_source {
            Some(HitRateSource::Responses) => '*',
            _ => ' ',
        };
        for run in &self.runs {
            let l = &run.live;
            let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v));
            let ms = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.0} ms"));
            let _ = writeln!(
                out,
                "{:<14} {:>9} {:>9} {:>8} {:>15} {:>15} {:>9.2} {:>6} {:>7}   {:>9} {:>8} {:>6}",
                run.policy.as_str(),
                pct(l.realized_hit_rate()) + &mark(run).to_string(),
                pct(l.predicted_hit_rate),
                run.pct_of_pooled.map_or("-".into(), |p| format!("{p:.1}%{}", mark(run))),
                ms(l.ttft.map(|t| t.p50_ms)),
                ms(l.ttft.map(|t| t.p99_ms)),
                l.throughput_rps,
                l.load_skew.map_or("-".into(), |s| format!("{s:.2}")),
                if l.failed() == 0 { "0".to_string() } else { format!("{}/{}", l.failed(), l.requests) },
                "",
                pct(run.offline.map(|o| o.hit_rate)),
                run.offline.map_or("-".into(), |o| format!("{:.2}", o.load_skew)),
            );
        }
        // The TTFT columns are the service's latency, from each request's actual send; in an
        // open loop a request may have waited for a free slot first, which users would see.
        let from_intended: Vec<String> = self
            .runs
            .iter()
            .filter_map(|run| {
                let t = run.live.ttft_from_intended?;
                Some(format!("{} p50 {:.0} ms, p99 {:.0} ms", run.policy.as_str(), t.p50_ms, t.p99_ms))
            })
            .collect();
        footnote(
            &mut out,
            "TTFT from the intended send (with any wait for a free in-flight slot)",
            &from_intended,
            "; ",
        );
        let from_responses: Vec<String> = self
            .runs
            .iter()
            .filter(|run| run.hit_rate_source == Some(HitRateSource::Responses))
            .map(|run| match run.live.replicas_unread {
                0 => run.policy.as_str().to_string(),
                n => format!("{} ({n} of {} replicas' counters unread)", run.policy.as_str(), f.replicas),
            })
            .collect();
        footnote(
            &mut out,
            "* hit rate from the responses' usage, not the replicas' counters (of the successes that reported cached tokens; % pooled is against the requests served, failed ones a replica may have run included)",
            &from_responses,
            ", ",
        );
        if f.engines != f.replicas {
            // The simulator routes over the engines as over replicas: its skew is theirs.
            let _ = writeln!(
                out,
                "\nskew: live over the {} replicas, offline over the {} engines (each data-parallel rank a replica of its own)",
                f.replicas, f.engines
            );
        }
        for run in self.runs.iter().filter(|r| r.compared_requests < w.requests) {
            let _ = writeln!(
                out,
                "\n{}: {} of {} requests reached a cache (the rest were refused before they ran, found no connection, or were never sent: a run stopped early); its % pooled ({:.1}% pooled hit rate) and offline figures are on those",
                run.policy.as_str(),
                run.compared_requests,
                w.requests,
                100.0 * run.pooled_hit_rate
            );
        }
        let reuse: Vec<String> = self
            .runs
            .iter()
            .filter_map(|run| {
                let reuse = run.live.router.as_ref()?.tokenize_reuse()?;
                Some(format!("{} {:.1}%", run.policy.as_str(), 100.0 * reuse))
            })
            .collect();
        if !reuse.is_empty() {
            let _ = writeln!(
                out,
                "\nprompt text the router's tokenizer cache did not tokenize again: {}",
                reuse.join(", ")
            );
        }
        // Time in the router's line is in the TTFT: said, when there was any.
        let waits: Vec<String> = self
            .runs
            .iter()
            .filter_map(|run| {
                let (waits, mean) = run.live.router.as_ref()?.queue_waits()?;
                Some(format!("{} {waits:.0} (mean {:.0} ms)", run.policy.as_str(), 1e3 * mean))
            })
            .collect();
        footnote(&mut out, "waits for room in the router's line (in the TTFT above)", &waits, ", ");
        out
    }
}

/// A line under the table, `what: items` (nothing when there are no items).
fn footnote(out: &mut String, what: &str, items: &[String], separator: &str) {
    if !items.is_empty() {
        let _ = writeln!(out, "\n{what}: {}", items.join(separator));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::live::scrape::{ReplicaCounters, Snapshot};
    use crate::live::{RequestRecord, Success};

    /// A run of two requests to two replicas (80 of 200 prompt tokens cached, by the
    /// responses), the replicas' counters read before it and after it as given.
    fn live(before: Vec<Option<ReplicaCounters>>, after: Vec<Option<ReplicaCounters>>) -> LiveReport {
        let records = (0..2)
            .map(|index| RequestRecord {
                index,
                intended: None,
                sent: Duration::ZERO,
                outcome: Ok(Success {
                    prompt_tokens: 100,
                    cached_tokens: Some(80 * (1 - index as u64)),
                    ..Success::default()
                }),
            })
            .collect();
        let urls = ["http://r0".to_string(), "http://r1".to_string()];
        let before = Snapshot { replicas: before, ..Snapshot::default() };
        let after = Snapshot { replicas: after, ..Snapshot::default() };
        LiveReport::new("x".into(), "t".into(), records, &urls, &before, &after)
    }

    fn report(runs: Vec<PolicyRun>) -> CompareReport {
        let workload = WorkloadSummary::of("w", &Trace::default(), PromptFormat::Ids);
        let fleet = FleetSummary {
            replicas: 2,
            engines: 2,
            total_capacity_blocks: 8,
            offload_capacity_blocks: 0,
            block_size: 16,
            eviction: cache::PolicyKind::Lru,
            s3fifo: None,
            time_scale: 6.0,
        };
        CompareReport { workload, fleet, pooled_hit_rate: 0.5, runs }
    }

    /// Regression: a run whose counters were partly unread fell back to the responses'
    /// hit rate, shown under the same "hit rate" as another run's counters.
    #[test]
    fn a_hit_rate_from_the_responses_is_marked() {
        let zero = Some(ReplicaCounters::default());
        let half = Some(ReplicaCounters {
            prefix_cache_hits: 50.0,
            prefix_cache_queries: 100.0,
            prompt_tokens: 100.0,
            started: None,
        });
        let counted =
            PolicyRun::new(PolicyKind::CacheAware, live(vec![zero; 2], vec![half; 2]), 0, 0.5, None);
        let partial =
            PolicyRun::new(PolicyKind::RoundRobin, live(vec![zero, None], vec![half; 2]), 0, 0.5, None);
        assert_eq!(counted.hit_rate_source, Some(HitRateSource::Counters));
        assert_eq!(partial.hit_rate_source, Some(HitRateSource::Responses));
        let report = report(vec![counted, partial]);
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["runs"][0]["hit_rate_source"], "counters");
        assert_eq!(json["runs"][1]["hit_rate_source"], "responses");
        let table = report.table();
        let row = |policy: &str| table.lines().find(|l| l.starts_with(policy)).unwrap().to_string();
        assert!(row("cache-aware").contains("50.0% ") && !row("cache-aware").contains('*'));
        assert!(row("round-robin").contains("40.0%*"), "{table}");
        assert!(table.contains("round-robin (1 of 2 replicas' counters unread)"), "{table}");
        // What the reference used, and in which time the latencies are.
        assert!(table.contains("one lru cache of 8 blocks"), "{table}");
        assert!(table.contains("time scale 6:"), "{table}");
        assert_eq!(
            (json["fleet"]["eviction"].as_str(), json["fleet"]["time_scale"].as_f64()),
            (Some("lru"), Some(6.0))
        );
    }

    /// A run whose every request failed is told apart (the demo and `compare` then fail).
    #[test]
    fn a_run_that_served_nothing_is_named() {
        let served = PolicyRun::new(PolicyKind::CacheAware, live(vec![None; 2], vec![None; 2]), 0, 0.5, None);
        let mut failed =
            PolicyRun::new(PolicyKind::RoundRobin, live(vec![None; 2], vec![None; 2]), 0, 0.5, None);
        failed.live.succeeded = 0;
        assert_eq!(report(vec![served.clone()]).served_nothing(), []);
        assert_eq!(report(vec![served, failed]).served_nothing(), [PolicyKind::RoundRobin]);
    }

    /// An S3FIFO reference names its settings, in the table and the JSON.
    #[test]
    fn an_s3fifo_reference_names_its_settings() {
        let mut report = report(Vec::new());
        report.fleet.eviction = cache::PolicyKind::S3fifo;
        report.fleet.s3fifo = Some(cache::S3FifoParams { small_ratio: 0.25, max_freq: 2 });
        let table = report.table();
        assert!(table.contains("one s3fifo (small queue 0.25, max freq 2) cache of 8 blocks"), "{table}");
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["fleet"]["s3fifo"]["small_ratio"], 0.25);
    }

    /// Regression: the TTFT columns (and the CDF) are from the actual send, while an
    /// open-loop run's JSON also has TTFT from the intended send; the table said neither.
    #[test]
    fn the_table_says_which_ttft_it_shows() {
        // Sent 50 ms late (it waited for a slot), first token 10 ms after the send.
        let late = RequestRecord {
            index: 0,
            intended: Some(Duration::ZERO),
            sent: Duration::from_millis(50),
            outcome: Ok(Success {
                ttft: Some(Duration::from_millis(10)),
                prompt_tokens: 100,
                ..Success::default()
            }),
        };
        let none = Snapshot::default();
        let open = LiveReport::new("x".into(), "t".into(), vec![late.clone()], &[], &none, &none);
        let closed = LiveReport::new(
            "x".into(),
            "t".into(),
            vec![RequestRecord { intended: None, ..late }],
            &[],
            &none,
            &none,
        );
        let run = |policy, live| PolicyRun::new(policy, live, 0, 0.5, None);
        let table =
            report(vec![run(PolicyKind::CacheAware, open), run(PolicyKind::RoundRobin, closed)]).table();
        let header = table.lines().find(|l| l.starts_with("policy")).unwrap();
        assert!(header.contains("TTFT p50 (send)") && header.contains("TTFT p99 (send)"), "{table}");
        let row = table.lines().find(|l| l.starts_with("cache-aware")).unwrap();
        assert!(row.contains("10 ms") && !row.contains("60 ms"), "{table}");
        let intended = table
            .lines()
            .find(|l| l.starts_with("TTFT from the intended send"))
            .unwrap_or_else(|| panic!("no TTFT from the intended send: {table}"));
        assert!(intended.contains("cache-aware p50 60 ms, p99 60 ms") && !intended.contains("round-robin"));
    }

    /// With data-parallel replicas the simulator's skew is over engines, the live one over
    /// replicas: the table says so (and says nothing when they are the same).
    #[test]
    fn the_table_says_what_each_skew_is_over() {
        let none = Snapshot::default();
        let live = LiveReport::new("x".into(), "t".into(), Vec::new(), &[], &none, &none);
        let mut dp = report(vec![PolicyRun::new(PolicyKind::CacheAware, live, 0, 0.5, None)]);
        assert!(!dp.table().contains("offline over"));
        dp.fleet.engines = 4;
        let table = dp.table();
        assert!(table.contains("skew: live over the 2 replicas, offline over the 4 engines"), "{table}");
    }
}
