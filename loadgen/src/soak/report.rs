//! What a soak reports: one [`Sample`] every few seconds (router memory, index size, request
//! totals, hit rate over the window since the previous sample, restarts), a per-minute table,
//! the [`Flatness`] verdict, and the files: `samples.csv`, `report.json`, `summary.txt` and
//! `memory.svg`.
//!
//! Flatness: the samples of the first third of the run are warm-up (caches and the index
//! filling, allocator arenas growing); the mean router RSS of the last third is compared to
//! that of the middle third, and the least-squares slope over both is given in MB per minute.
//! The run counts as flat when the growth stays under [`FLAT_GROWTH_PCT`]. It is a reported
//! verdict, never an assertion. With text prompts the router's tokenizer cache fills toward
//! its bound during the run; the same growth of the RSS less the cache's weight tells whether
//! anything else grows.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;
use serde::Serialize;

use super::tally::Totals;
use crate::plot::{self, err};

/// Growth of the last third's mean RSS over the middle third's, in percent, below which the
/// memory counts as flat.
pub const FLAT_GROWTH_PCT: f64 = 5.0;

const MB: f64 = 1024.0 * 1024.0;

/// The fleet and router at one instant.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Sample {
    /// Seconds since the load started.
    pub t_s: f64,
    /// The router's `VmRSS`, bytes (`None` when `/proc` could not be read).
    pub router_rss: Option<u64>,
    /// The router's `RssAnon`, bytes.
    pub router_rss_anon: Option<u64>,
    /// `kvroute_ingest_index_memory_bytes`: the index's own estimate of its heap.
    pub index_memory_bytes: Option<u64>,
    /// `kvroute_ingest_index_entries`: (block, replica) pairs.
    pub index_entries: Option<u64>,
    /// `kvroute_router_tokenize_cache_bytes`: the weight of the router's tokenizer prefix
    /// cache (token ids, 4 bytes each), which fills up to `--tokenize-cache-bytes` with text
    /// prompts and stays empty with token ids.
    pub tokenize_cache_bytes: Option<u64>,
    /// `kvroute_router_in_flight`.
    pub router_in_flight: Option<u64>,
    /// Publisher restarts the router detected (`kvroute_ingest_restarts`, summed).
    pub router_seen_restarts: Option<u64>,
    /// Times the router cleared a replica's index entries (`kvroute_ingest_clears`, summed):
    /// a closed event connection or a detected restart.
    pub router_index_clears: Option<u64>,
    /// Replicas the soak has restarted so far.
    pub replica_restarts: u64,
    /// Request totals so far.
    pub totals: Totals,
    /// `cached / prompt` tokens of the requests finished since the previous sample whose
    /// responses reported `cached_tokens`.
    pub window_hit_rate: Option<f64>,
    /// The router's predicted hit rate (`predicted / prompt` tokens) of the requests finished
    /// since the previous sample whose responses carried its prediction header: not the same
    /// requests as `window_hit_rate`'s, since a response without the header predicted nothing.
    pub window_predicted_hit_rate: Option<f64>,
}

/// The memory verdict.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Flatness {
    /// Mean router RSS over the middle third of the samples, MB.
    pub middle_rss_mb: f64,
    /// Mean router RSS over the last third, MB.
    pub last_rss_mb: f64,
    /// `last / middle - 1`, percent.
    pub growth_pct: f64,
    /// Least-squares slope of the RSS over the last two thirds, MB per minute.
    pub slope_mb_per_min: f64,
    /// The same comparison for the index's own estimate, percent.
    pub index_growth_pct: Option<f64>,
    /// The tokenizer cache's mean weight over the last third less the middle third's, MB:
    /// growth that is the cache filling toward its bound.
    pub tokenize_cache_growth_mb: Option<f64>,
    /// [`Self::growth_pct`] of the RSS less the tokenizer cache's weight, percent: whether
    /// what is not the (bounded) cache grows. The cache costs more RSS than its weight
    /// (allocator overhead), so a filling cache still shows here, smaller.
    pub net_of_cache_growth_pct: Option<f64>,
    /// `growth_pct < FLAT_GROWTH_PCT`.
    pub flat: bool,
}

impl Flatness {
    /// `None` with fewer than six samples carrying an RSS.
    pub fn of(samples: &[Sample]) -> Option<Self> {
        let rss: Vec<(f64, f64)> =
            samples.iter().filter_map(|s| Some((s.t_s, s.router_rss? as f64 / MB))).collect();
        if rss.len() < 6 {
            return None;
        }
        let third = rss.len() / 3;
        let (middle, last) = (&rss[third..2 * third], &rss[2 * third..]);
        let mean = |xs: &[(f64, f64)]| xs.iter().map(|p| p.1).sum::<f64>() / xs.len() as f64;
        let (middle_rss_mb, last_rss_mb) = (mean(middle), mean(last));
        let growth_pct = 100.0 * (last_rss_mb / middle_rss_mb - 1.0);
        let index: Vec<f64> = samples.iter().filter_map(|s| Some(s.index_memory_bytes? as f64)).collect();
        let index_growth_pct = (index.len() >= 6).then(|| {
            let third = index.len() / 3;
            let m = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
            let (a, b) = (m(&index[third..2 * third]), m(&index[2 * third..]));
            if a > 0.0 { 100.0 * (b / a - 1.0) } else { 0.0 }
        });
        let cache: Vec<f64> =
            samples.iter().filter_map(|s| Some(s.tokenize_cache_bytes? as f64 / MB)).collect();
        let tokenize_cache_growth_mb = (cache.len() >= 6).then(|| {
            let third = cache.len() / 3;
            let m = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
            m(&cache[2 * third..]) - m(&cache[third..2 * third])
        });
        let net: Vec<f64> = samples
            .iter()
            .filter_map(|s| Some((s.router_rss? as f64 - s.tokenize_cache_bytes? as f64) / MB))
            .collect();
        let net_of_cache_growth_pct = (net.len() >= 6).then(|| {
            let third = net.len() / 3;
            let m = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
            100.0 * (m(&net[2 * third..]) / m(&net[third..2 * third]) - 1.0)
        });
        Some(Self {
            middle_rss_mb,
            last_rss_mb,
            growth_pct,
            slope_mb_per_min: 60.0 * slope(&rss[third..]),
            index_growth_pct,
            tokenize_cache_growth_mb,
            net_of_cache_growth_pct,
            flat: growth_pct < FLAT_GROWTH_PCT,
        })
    }
}

/// Least-squares slope of `(x, y)` points.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    if sxx > 0.0 { sxy / sxx } else { 0.0 }
}

/// One row of the per-minute table: the last sample of the minute, the window its minute.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MinuteRow {
    pub minute: u64,
    pub rss_mb: Option<f64>,
    pub rss_anon_mb: Option<f64>,
    pub index_mb: Option<f64>,
    pub entries: Option<u64>,
    /// The tokenizer cache's weight.
    pub tokenize_cache_mb: Option<f64>,
    /// Requests finished during the minute.
    pub done: u64,
    /// Unexpected errors during the minute.
    pub errors: u64,
    /// Lost to churn during the minute.
    pub lost_to_churn: u64,
    /// Realized hit rate of the minute's requests.
    pub hit_rate: Option<f64>,
    /// Replicas restarted during the minute.
    pub replica_restarts: u64,
}

/// The whole soak.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SoakReport {
    /// The settings, as given.
    pub config: BTreeMap<String, String>,
    pub samples: Vec<Sample>,
    pub minutes: Vec<MinuteRow>,
    /// Totals at the end.
    pub totals: Totals,
    pub replica_restarts: u64,
    /// Seconds from the start of the load to the last sample, taken once every request has
    /// ended (or been cut off at the run's end).
    pub duration_s: f64,
    /// `cached / prompt` over the whole run.
    pub hit_rate: Option<f64>,
    pub flatness: Option<Flatness>,
    /// Whether the run stopped early (Ctrl-C, or the workload ran out).
    pub stopped_early: Option<String>,
}

fn ratio(a: u64, b: u64) -> Option<f64> {
    (b > 0).then(|| a as f64 / b as f64)
}

/// The hit rates of the requests finished between two totals.
pub fn window_rates(before: &Totals, after: &Totals) -> (Option<f64>, Option<f64>) {
    let delta = |f: fn(&Totals) -> u64| f(after).saturating_sub(f(before));
    (
        ratio(delta(|t| t.cached_tokens), delta(|t| t.prompt_tokens)),
        ratio(delta(|t| t.predicted_tokens), delta(|t| t.predicted_prompt_tokens)),
    )
}

impl SoakReport {
    pub fn new(
        config: BTreeMap<String, String>,
        samples: Vec<Sample>,
        duration_s: f64,
        stopped_early: Option<String>,
    ) -> Self {
        let totals = samples.last().map(|s| s.totals.clone()).unwrap_or_default();
        let replica_restarts = samples.last().map_or(0, |s| s.replica_restarts);
        Self {
            config,
            minutes: minutes(&samples),
            hit_rate: ratio(totals.cached_tokens, totals.prompt_tokens),
            flatness: Flatness::of(&samples),
            totals,
            replica_restarts,
            duration_s,
            samples,
            stopped_early,
        }
    }

    /// The samples as CSV, one line each.
    pub fn csv(&self) -> String {
        let mut out = String::from(
            "t_s,router_rss_bytes,router_rss_anon_bytes,index_memory_bytes,index_entries,router_in_flight,\
             sent,done,succeeded,lost_to_churn,unexpected_errors,window_hit_rate,window_predicted_hit_rate,\
             replica_restarts,router_seen_restarts,router_index_clears,tokenize_cache_bytes\n",
        );
        let opt = |v: Option<u64>| v.map_or(String::new(), |v| v.to_string());
        let rate = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.4}"));
        for s in &self.samples {
            let t = &s.totals;
            let _ = writeln!(
                out,
                "{:.1},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
                s.t_s,
                opt(s.router_rss),
                opt(s.router_rss_anon),
                opt(s.index_memory_bytes),
                opt(s.index_entries),
                opt(s.router_in_flight),
                t.sent,
                t.done,
                t.succeeded,
                t.lost_to_churn,
                t.unexpected_errors(),
                rate(s.window_hit_rate),
                rate(s.window_predicted_hit_rate),
                s.replica_restarts,
                opt(s.router_seen_restarts),
                opt(s.router_index_clears),
                opt(s.tokenize_cache_bytes),
            );
        }
        out
    }

    /// The per-minute table, totals and verdict, for a terminal.
    pub fn summary(&self) -> String {
        let mb = |v: Option<f64>| v.map_or("-".into(), |v| format!("{v:.1}"));
        let pct = |v: Option<f64>| v.map_or("-".into(), |v| format!("{:.1}%", 100.0 * v));
        let mut out = String::from(
            "minute  RSS MB  anon MB  index MB   entries  tok. cache MB   done  errors  churn-lost  hit rate  restarts\n",
        );
        for m in &self.minutes {
            let _ = writeln!(
                out,
                "{:>6}  {:>6}  {:>7}  {:>8}  {:>8}  {:>13}  {:>5}  {:>6}  {:>10}  {:>8}  {:>8}",
                m.minute,
                mb(m.rss_mb),
                mb(m.rss_anon_mb),
                mb(m.index_mb),
                m.entries.map_or("-".into(), |e| e.to_string()),
                mb(m.tokenize_cache_mb),
                m.done,
                m.errors,
                m.lost_to_churn,
                pct(m.hit_rate),
                m.replica_restarts
            );
        }
        let t = &self.totals;
        let _ = writeln!(
            out,
            "\n{} requests in {:.0} s: {} succeeded, {} lost to churn, {} cut off by the run's end, {} unexpected errors {:?}; {} replica restarts; hit rate {}",
            t.done,
            self.duration_s,
            t.succeeded,
            t.lost_to_churn,
            t.cancelled,
            t.unexpected_errors(),
            t.unexpected,
            self.replica_restarts,
            pct(self.hit_rate)
        );
        let _ = writeln!(
            out,
            "{} sent, {} of them over {} ms after their arrival time (every slot taken; at most {} ms): the rate asked was {}",
            t.sent,
            t.late,
            super::tally::LATE.as_millis(),
            t.most_late_ms,
            if t.late == 0 && !t.unexpected.contains_key("unsent") { "kept" } else { "not kept" }
        );
        match &self.flatness {
            Some(f) => {
                let _ = writeln!(
                    out,
                    "memory: middle third {:.1} MB, last third {:.1} MB: growth {:+.2}% (slope {:+.3} MB/min; index {}{}): {}",
                    f.middle_rss_mb,
                    f.last_rss_mb,
                    f.growth_pct,
                    f.slope_mb_per_min,
                    f.index_growth_pct.map_or("-".into(), |g| format!("{g:+.2}%")),
                    match (f.tokenize_cache_growth_mb, f.net_of_cache_growth_pct) {
                        (Some(g), Some(net)) if g.abs() >= 0.05 => format!(
                            "; tokenizer cache {g:+.1} MB, filling toward its bound; RSS less the cache {net:+.2}%"
                        ),
                        _ => String::new(),
                    },
                    if f.flat {
                        format!("FLAT (under {FLAT_GROWTH_PCT}%)")
                    } else {
                        format!("GROWING (over {FLAT_GROWTH_PCT}%)")
                    }
                );
            }
            None => out.push_str("memory: too few samples for a verdict\n"),
        }
        if let Some(why) = &self.stopped_early {
            let _ = writeln!(out, "stopped early: {why}");
        }
        out
    }

    /// Writes `samples.csv`, `report.json`, `summary.txt` and `memory.svg` into `dir`.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
        };
        write("samples.csv", self.csv())?;
        write("summary.txt", self.summary())?;
        write("report.json", serde_json::to_string_pretty(self).context("serialising the report")? + "\n")?;
        plot_memory(self, &dir.join("memory.svg")).context("plotting memory over time")
    }
}

/// The last sample of every minute, with the minute's deltas.
fn minutes(samples: &[Sample]) -> Vec<MinuteRow> {
    let mut rows = Vec::new();
    let (mut previous, mut restarts_before) = (Totals::default(), 0);
    let mut i = 0;
    while i < samples.len() {
        let minute = (samples[i].t_s / 60.0).floor() as u64;
        let mut last = i;
        while last + 1 < samples.len() && (samples[last + 1].t_s / 60.0).floor() as u64 == minute {
            last += 1;
        }
        let s = &samples[last];
        let t = &s.totals;
        rows.push(MinuteRow {
            minute,
            rss_mb: s.router_rss.map(|v| v as f64 / MB),
            rss_anon_mb: s.router_rss_anon.map(|v| v as f64 / MB),
            index_mb: s.index_memory_bytes.map(|v| v as f64 / MB),
            entries: s.index_entries,
            tokenize_cache_mb: s.tokenize_cache_bytes.map(|v| v as f64 / MB),
            done: t.done - previous.done,
            errors: t.unexpected_errors() - previous.unexpected_errors(),
            lost_to_churn: t.lost_to_churn - previous.lost_to_churn,
            hit_rate: window_rates(&previous, t).0,
            replica_restarts: s.replica_restarts.saturating_sub(restarts_before),
        });
        previous = t.clone();
        restarts_before = s.replica_restarts;
        i = last + 1;
    }
    rows
}

/// Router RSS, anonymous RSS and the index estimate (MB) against time, with a tick along the
/// top at every replica restart.
fn plot_memory(report: &SoakReport, path: &Path) -> anyhow::Result<()> {
    let series = |f: fn(&Sample) -> Option<u64>| -> Vec<(f64, f64)> {
        report.samples.iter().filter_map(|s| Some((s.t_s / 60.0, f(s)? as f64 / MB))).collect()
    };
    let rss = series(|s| s.router_rss);
    let anon = series(|s| s.router_rss_anon);
    let index = series(|s| s.index_memory_bytes);
    let x_max = report.samples.last().map_or(1.0, |s| s.t_s / 60.0).max(0.1);
    let y_max = rss.iter().chain(&anon).chain(&index).map(|p| p.1).fold(1.0_f64, f64::max) * 1.15;

    let root = plot::canvas(path)?;
    let mut chart = plot::frame(&root, "Router memory during the soak", 0.0..x_max, 0.0..y_max, 55)?;
    chart
        .configure_mesh()
        .x_desc("minutes since start")
        .y_desc("MB")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(err)?;
    let restarts: Vec<f64> = report
        .samples
        .windows(2)
        .filter(|w| w[1].replica_restarts > w[0].replica_restarts)
        .map(|w| w[1].t_s / 60.0)
        .collect();
    let grey = RGBColor(120, 120, 120);
    chart
        .draw_series(restarts.iter().map(|&x| PathElement::new([(x, y_max * 0.93), (x, y_max)], grey)))
        .map_err(err)?
        .label("replica restart")
        .legend(move |(x, y)| PathElement::new([(x + 10, y - 5), (x + 10, y + 5)], grey));
    for (i, (name, points)) in
        [("router VmRSS", rss), ("router RssAnon", anon), ("index estimate", index)].into_iter().enumerate()
    {
        plot::line(&mut chart, points, plot::color(i), name)?;
    }
    plot::finish(chart, &root, SeriesLabelPosition::LowerRight)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, rss_mb: f64, done: u64, prompt: u64, cached: u64) -> Sample {
        Sample {
            t_s,
            router_rss: Some((rss_mb * MB) as u64),
            index_memory_bytes: Some(1000),
            totals: Totals { done, prompt_tokens: prompt, cached_tokens: cached, ..Totals::default() },
            ..Sample::default()
        }
    }

    #[test]
    fn flat_memory_after_warm_up_is_flat_and_growth_is_not() {
        // Warm-up from 10 to 40 MB, then flat at 40.
        let flat: Vec<Sample> = (0..30)
            .map(|i| sample(i as f64 * 10.0, if i < 10 { 10.0 + 3.0 * i as f64 } else { 40.0 }, 0, 0, 0))
            .collect();
        let f = Flatness::of(&flat).unwrap();
        assert!(f.flat && f.growth_pct.abs() < 1e-9 && f.slope_mb_per_min.abs() < 1e-9, "{f:?}");
        assert_eq!(f.index_growth_pct, Some(0.0));
        // 3 MB a minute on top of 40 MB.
        let leak: Vec<Sample> =
            (0..30).map(|i| sample(i as f64 * 10.0, 40.0 + i as f64 / 2.0, 0, 0, 0)).collect();
        let f = Flatness::of(&leak).unwrap();
        assert!(!f.flat && (f.slope_mb_per_min - 3.0).abs() < 1e-5, "{f:?}");
        assert_eq!(Flatness::of(&leak[..5]), None);
        assert_eq!(f.tokenize_cache_growth_mb, None);
        // The same growth while the tokenizer cache fills by 1 MB a minute: said (the thirds'
        // middles are 100 s apart), and still growth (its weight is not all it costs in RSS).
        let filling: Vec<Sample> = leak
            .iter()
            .map(|s| Sample { tokenize_cache_bytes: Some((s.t_s / 60.0 * MB) as u64), ..s.clone() })
            .collect();
        let f = Flatness::of(&filling).unwrap();
        assert!(
            !f.flat && f.tokenize_cache_growth_mb.is_some_and(|g| (g - 100.0 / 60.0).abs() < 0.01),
            "{f:?}"
        );
        // Less the cache's weight, 2 MB a minute are left of the 3: the thirds' means are 40
        // MB and 2 MB a minute at 245 s and at 145 s.
        let net = 100.0 * ((40.0 + 2.0 * 245.0 / 60.0) / (40.0 + 2.0 * 145.0 / 60.0) - 1.0);
        assert!(f.net_of_cache_growth_pct.is_some_and(|g| (g - net).abs() < 0.01), "{f:?} {net}");
        assert_eq!(Flatness::of(&leak).unwrap().net_of_cache_growth_pct, None);
    }

    #[test]
    fn minutes_take_the_last_sample_and_the_minute_s_deltas() {
        let samples = vec![
            sample(10.0, 10.0, 5, 100, 10),
            sample(50.0, 11.0, 10, 200, 50),
            sample(70.0, 12.0, 20, 400, 250),
            sample(110.0, 13.0, 30, 600, 450),
        ];
        let report = SoakReport::new(BTreeMap::new(), samples, 110.0, None);
        assert_eq!(report.minutes.len(), 2);
        let (a, b) = (&report.minutes[0], &report.minutes[1]);
        assert_eq!((a.minute, a.done, a.hit_rate), (0, 10, Some(0.25)));
        assert_eq!((b.minute, b.done, b.hit_rate), (1, 20, Some(1.0)));
        assert_eq!(b.rss_mb, Some(13.0));
        assert_eq!(report.hit_rate, Some(0.75));
        assert_eq!(report.csv().lines().count(), 5);
        assert_eq!(report.flatness, None);
    }

    /// A minute's restarts are that minute's, as its other counts are (the samples' are
    /// the run's so far).
    #[test]
    fn a_minutes_restarts_are_its_own() {
        let mut samples = vec![
            sample(10.0, 10.0, 5, 100, 10),
            sample(70.0, 12.0, 20, 400, 250),
            sample(130.0, 13.0, 30, 600, 450),
        ];
        for (s, restarts) in samples.iter_mut().zip([1, 3, 3]) {
            s.replica_restarts = restarts;
        }
        let report = SoakReport::new(BTreeMap::new(), samples, 130.0, None);
        let per_minute: Vec<u64> = report.minutes.iter().map(|m| m.replica_restarts).collect();
        assert_eq!(per_minute, [1, 2, 0]);
        assert_eq!(report.replica_restarts, 3);
    }
}
