//! The compare report's plots, as SVG (no fonts needed: the SVG viewer renders the text):
//! - `hit_rate_over_time.svg`: cumulative realized hit rate by completion time, per policy;
//! - `ttft_cdf.svg`: the distribution of time to first token from each request's actual
//!   send, per policy;
//! - `tokens_per_replica.svg`: prompt tokens each replica received, grouped by replica.

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

use super::CompareReport;
use crate::live::report::ReplicaShare;
use crate::plot::{self, color, err, finish, frame, line};

/// Writes every plot into `dir`.
pub fn write_all(report: &CompareReport, dir: &Path) -> anyhow::Result<()> {
    hit_rate_over_time(report, &dir.join("hit_rate_over_time.svg")).context("plotting hit rate over time")?;
    ttft_cdf(report, &dir.join("ttft_cdf.svg")).context("plotting the TTFT CDF")?;
    tokens_per_replica(report, &dir.join("tokens_per_replica.svg")).context("plotting tokens per replica")?;
    Ok(())
}

fn hit_rate_over_time(report: &CompareReport, path: &Path) -> anyhow::Result<()> {
    let root = plot::canvas(path)?;
    let x_max = report
        .runs
        .iter()
        .flat_map(|r| r.live.hit_rate_over_time.iter().map(|p| p.0))
        .fold(1.0_f64, f64::max);
    // From each response's usage, whichever source the report's table took (the replicas'
    // counters are read only before and after a run).
    let title = "Realized prefix-cache hit rate (cumulative, responses' usage)";
    let mut chart = frame(&root, title, 0.0..x_max, 0.0..100.0, 55)?;
    chart
        .configure_mesh()
        .x_desc("time since start (s)")
        .y_desc("hit rate (%)")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(err)?;
    // The pooled reference of the whole workload; a run that stopped early has its own, on
    // the requests it served, drawn in its colour.
    let whole = report.workload.requests;
    let references: Vec<(f64, RGBColor, String)> = if report.runs.iter().all(|r| r.compared_requests == whole)
    {
        vec![(report.pooled_hit_rate, BLACK, "pooled reference".into())]
    } else {
        let each = report.runs.iter().enumerate();
        each.map(|(i, r)| (r.pooled_hit_rate, color(i), format!("pooled, {}'s requests", r.policy.as_str())))
            .collect()
    };
    for (rate, c, label) in references {
        let pooled = 100.0 * rate;
        chart
            .draw_series(LineSeries::new([(0.0, pooled), (x_max, pooled)], c.stroke_width(1)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], c));
    }
    for (i, run) in report.runs.iter().enumerate() {
        let c = color(i);
        let points = run.live.hit_rate_over_time.iter().map(|&(t, r)| (t, 100.0 * r));
        line(&mut chart, points, c, run.policy.as_str())?;
    }
    finish(chart, &root, SeriesLabelPosition::LowerRight)
}

fn ttft_cdf(report: &CompareReport, path: &Path) -> anyhow::Result<()> {
    let curves: Vec<Vec<f64>> = report
        .runs
        .iter()
        .map(|run| {
            let mut ms: Vec<f64> = run
                .live
                .records
                .iter()
                .filter_map(|r| r.outcome.as_ref().ok()?.ttft.map(|t| t.as_secs_f64() * 1e3))
                .collect();
            ms.sort_unstable_by(f64::total_cmp);
            ms
        })
        .collect();
    let x_max = curves.iter().filter_map(|c| c.last().copied()).fold(1.0_f64, f64::max);
    let root = plot::canvas(path)?;
    let mut chart =
        frame(&root, "Time to first token from the actual send (CDF)", 0.0..x_max * 1.02, 0.0..1.0, 55)?;
    chart
        .configure_mesh()
        .x_desc("TTFT from the send (ms)")
        .y_desc("fraction of successful requests")
        .draw()
        .map_err(err)?;
    for (i, (run, ms)) in report.runs.iter().zip(&curves).enumerate() {
        let c = color(i);
        let n = ms.len() as f64;
        let points = ms.iter().enumerate().map(|(k, &v)| (v, (k + 1) as f64 / n));
        line(&mut chart, points, c, run.policy.as_str())?;
    }
    finish(chart, &root, SeriesLabelPosition::LowerRight)
}

fn tokens_per_replica(report: &CompareReport, path: &Path) -> anyhow::Result<()> {
    let (names, columns) = replica_columns(report.runs.iter().map(|run| run.live.per_replica.as_slice()));
    let replicas = names.len().max(1);
    let y_max = report
        .runs
        .iter()
        .flat_map(|r| r.live.per_replica.iter().map(|s| s.prompt_tokens as f64))
        .fold(1.0_f64, f64::max);
    let root = plot::canvas(path)?;
    let mut chart =
        frame(&root, "Prompt tokens per replica", -0.5..replicas as f64 - 0.5, 0.0..y_max * 1.1, 80)?;
    chart
        .configure_mesh()
        .x_desc("replica")
        .y_desc("prompt tokens")
        .y_label_formatter(&|v| format!("{:.0}k", v / 1e3))
        .x_labels(replicas)
        .x_label_formatter(&|x| {
            let column = usize::try_from(x.round() as i64).ok();
            column.and_then(|c| names.get(c)).cloned().unwrap_or_default()
        })
        .disable_x_mesh()
        .draw()
        .map_err(err)?;
    let width = 0.8 / report.runs.len().max(1) as f64;
    for (i, (run, columns)) in report.runs.iter().zip(&columns).enumerate() {
        let c = color(i);
        let bars = run.live.per_replica.iter().zip(columns).map(move |(share, &r)| {
            let x0 = r as f64 - 0.4 + i as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width * 0.9, share.prompt_tokens as f64)], c.filled())
        });
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(run.policy.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 15, y + 5)], c.filled()));
    }
    finish(chart, &root, SeriesLabelPosition::UpperRight)
}

/// Every replica the runs name, in the order first named, and each run's replicas' places
/// among them: a replica's bars stand together by its name, not by its place in each run's
/// list (a run read from counters lists replicas by URL, one read from the router's headers
/// by the router's names, in another order).
fn replica_columns<'a>(runs: impl Iterator<Item = &'a [ReplicaShare]>) -> (Vec<String>, Vec<Vec<usize>>) {
    let mut names: Vec<String> = Vec::new();
    let columns = runs
        .map(|shares| {
            shares
                .iter()
                .map(|share| match names.iter().position(|n| *n == share.replica) {
                    Some(at) => at,
                    None => {
                        names.push(share.replica.clone());
                        names.len() - 1
                    }
                })
                .collect()
        })
        .collect();
    (names, columns)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica's bars stand together whatever its place in each run's list; replicas named
    /// otherwise (a URL against a router name) get columns of their own. Bars went by place:
    /// one run's `b` stood over another's `a`.
    #[test]
    fn a_replicas_bars_stand_together_by_its_name() {
        let shares = |names: &[&str]| -> Vec<ReplicaShare> {
            names
                .iter()
                .map(|n| ReplicaShare { replica: (*n).into(), prompt_tokens: 1, hit_rate: None })
                .collect()
        };
        let runs = [shares(&["a", "b"]), shares(&["b", "a"]), shares(&["http://r0", "a"])];
        let (names, columns) = replica_columns(runs.iter().map(Vec::as_slice));
        assert_eq!(names, ["a", "b", "http://r0"]);
        assert_eq!(columns, [vec![0, 1], vec![1, 0], vec![2, 0]]);
    }
}
