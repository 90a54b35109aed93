//! Running totals of the soak's requests, updated as each one finishes and read at every
//! sample, and the rule that tells a loss to churn from an unexpected error.
//!
//! A failed request is **lost to churn** when a replica was killed while it was in flight
//! (sent before the kill, failed after it) and the router either named that replica in its
//! `x-kvroute-replica` header or sent no header at all (it failed before answering), unless
//! it timed out with no header: a killed replica's requests fail at once (their connection is
//! closed, and the router retries what had no answer yet), so a timeout before any answer is
//! a replica or router that stalled, whatever was killed meanwhile. Every other failure is
//! **unexpected** and counted by kind.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::live::{ErrorKind, Success};

/// A replica kill, as the churn loop recorded it before sending the signal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kill {
    pub at: Instant,
    pub replica: String,
}

/// Cumulative counts at one instant.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Totals {
    /// Requests sent.
    pub sent: u64,
    /// Requests finished, successfully or not, and those due that were never sent (`unsent`
    /// errors).
    pub done: u64,
    /// Requests sent later than their arrival time, for want of a free slot (`--max-in-flight`
    /// of them were in flight), by more than [`LATE`].
    pub late: u64,
    /// The most any request was sent after its arrival time, ms.
    pub most_late_ms: u64,
    pub succeeded: u64,
    /// Failures attributed to a killed replica.
    pub lost_to_churn: u64,
    /// Requests the run's end (Ctrl-C) cut off: neither churn nor a fault.
    pub cancelled: u64,
    /// Every other failure, by kind (`http_502`, `stream`, `timeout`, ...).
    pub unexpected: BTreeMap<String, u64>,
    /// A response has said its `cached_tokens`: from then on, a usage without them is a miss
    /// ([`Success::cached_tokens_given`]).
    #[serde(skip)]
    pub reports_cached: bool,
    /// Prompt tokens of successful requests with a usage but no `cached_tokens` before any
    /// response said them: misses, once one does (added to `prompt_tokens` then, so the
    /// window it comes in takes them all; vLLM leaves a miss's out, and a soak that starts
    /// cold would leave out its first misses).
    #[serde(skip)]
    pub unreported_prompt_tokens: u64,
    /// Prompt tokens of successful requests that reported `cached_tokens` (or a miss).
    pub prompt_tokens: u64,
    /// Their `cached_tokens`.
    pub cached_tokens: u64,
    /// Router-predicted cached tokens (`x-kvroute-predicted-cached-tokens`) of successful
    /// requests that carried the header.
    pub predicted_tokens: u64,
    /// Their prompt tokens: the predicted hit rate's denominator (a response without the
    /// header predicted nothing, so it is left out, as in a live run's report).
    pub predicted_prompt_tokens: u64,
}

impl Totals {
    pub fn unexpected_errors(&self) -> u64 {
        self.unexpected.values().sum()
    }

    pub fn in_flight(&self) -> u64 {
        let unsent = self.unexpected.get("unsent").copied().unwrap_or(0);
        (self.sent + unsent).saturating_sub(self.done)
    }
}

/// How late a request may be sent after its arrival time before it counts as late.
pub const LATE: Duration = Duration::from_millis(100);

/// The shared tally: request tasks and the churn loop write, the sampler reads. The lock is
/// held for a few additions, never across an `.await`.
#[derive(Clone, Debug, Default)]
pub struct Tally {
    inner: Arc<Mutex<State>>,
}

#[derive(Debug, Default)]
struct State {
    totals: Totals,
    kills: Vec<Kill>,
    /// Kills whose replica came back.
    restarts: usize,
}

impl Tally {
    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> T {
        // Only counters live here; a panicking holder leaves them usable.
        f(&mut self.inner.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Records a request sent `late` after its arrival time.
    pub fn sent(&self, late: Duration) {
        self.with(|s| {
            s.totals.sent += 1;
            s.totals.late += u64::from(late > LATE);
            s.totals.most_late_ms = s.totals.most_late_ms.max(late.as_millis() as u64);
        });
    }

    /// Records `n` requests due that were never sent: done, as unexpected errors (`unsent`),
    /// and not sent.
    pub fn unsent(&self, n: u64) {
        self.with(|s| {
            s.totals.done += n;
            *s.totals.unexpected.entry("unsent".into()).or_insert(0) += n;
        });
    }

    /// Records a kill (call it before killing, so no failure it causes can precede it).
    pub fn killing(&self, replica: &str) {
        self.with(|s| s.kills.push(Kill { at: Instant::now(), replica: replica.into() }));
    }

    /// Records a finished request sent at `sent`; `replica` is the router's header, if any.
    pub fn finished(&self, sent: Instant, replica: Option<&str>, outcome: &Result<Success, ErrorKind>) {
        let now = Instant::now();
        self.with(|s| {
            let t = &mut s.totals;
            t.done += 1;
            match outcome {
                Ok(ok) => {
                    t.succeeded += 1;
                    if !t.reports_cached && ok.cached_tokens.is_some() {
                        t.reports_cached = true;
                        t.prompt_tokens += std::mem::take(&mut t.unreported_prompt_tokens);
                    }
                    match ok.cached_tokens_given(t.reports_cached) {
                        Some(cached) => {
                            t.prompt_tokens += ok.prompt_tokens;
                            t.cached_tokens += cached;
                        }
                        None if ok.usage => t.unreported_prompt_tokens += ok.prompt_tokens,
                        None => {}
                    }
                    if let Some(predicted) = ok.predicted_cached_tokens {
                        t.predicted_prompt_tokens += ok.prompt_tokens;
                        t.predicted_tokens += predicted;
                    }
                }
                Err(ErrorKind::Cancelled) => t.cancelled += 1,
                Err(kind)
                    if !(*kind == ErrorKind::Timeout && replica.is_none())
                        && lost_to_churn(&s.kills, sent, now, replica) =>
                {
                    tracing::debug!(error = kind.label(), ?replica, "request lost to churn");
                    t.lost_to_churn += 1;
                }
                Err(kind) => *t.unexpected.entry(kind.label()).or_insert(0) += 1,
            }
        });
    }

    pub fn totals(&self) -> Totals {
        self.with(|s| s.totals.clone())
    }

    pub fn kills(&self) -> usize {
        self.with(|s| s.kills.len())
    }

    /// A killed replica is back.
    pub fn restarted(&self) {
        self.with(|s| s.restarts += 1);
    }

    /// Kills whose replica came back ([`Tally::restarted`]).
    pub fn restarts(&self) -> usize {
        self.with(|s| s.restarts)
    }
}

/// Whether a request in flight over `[sent, failed]` on `replica` (as the router named it)
/// was cut by one of `kills`.
pub fn lost_to_churn(kills: &[Kill], sent: Instant, failed: Instant, replica: Option<&str>) -> bool {
    kills
        .iter()
        .rev()
        .take_while(|k| k.at >= sent)
        .any(|k| k.at <= failed && replica.is_none_or(|r| r == k.replica))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn only_failures_in_flight_on_the_killed_replica_are_churn() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let kills =
            vec![Kill { at: at(100), replica: "a".into() }, Kill { at: at(200), replica: "b".into() }];
        // In flight over the kill of `a`, named `a` or unnamed: churn.
        assert!(lost_to_churn(&kills, at(50), at(150), Some("a")));
        assert!(lost_to_churn(&kills, at(50), at(150), None));
        // On another replica, or outside every kill: unexpected.
        assert!(!lost_to_churn(&kills, at(50), at(150), Some("b")));
        assert!(!lost_to_churn(&kills, at(120), at(180), Some("a")));
        assert!(!lost_to_churn(&kills, at(210), at(300), None));
        // Spanning both kills.
        assert!(lost_to_churn(&kills, at(50), at(250), Some("b")));
    }

    #[test]
    fn the_tally_counts_successes_churn_and_errors() {
        let tally = Tally::default();
        let sent = Instant::now();
        for _ in 0..4 {
            tally.sent(Duration::ZERO);
        }
        let ok = Success { prompt_tokens: 100, cached_tokens: Some(40), ..Success::default() };
        tally.finished(sent, Some("a"), &Ok(ok));
        tally.killing("a");
        tally.finished(sent, Some("a"), &Err(ErrorKind::Stream));
        tally.finished(sent, Some("b"), &Err(ErrorKind::Stream));
        // Cut off by the run's end, across a kill: not lost to churn, and no fault either.
        tally.finished(sent, None, &Err(ErrorKind::Cancelled));
        // Timed out before any answer: a stall, whatever was killed meanwhile.
        tally.sent(Duration::ZERO);
        tally.finished(sent, None, &Err(ErrorKind::Timeout));
        let totals = tally.totals();
        assert_eq!((totals.sent, totals.done, totals.in_flight()), (5, 5, 0));
        assert_eq!((totals.succeeded, totals.lost_to_churn, totals.unexpected_errors()), (1, 1, 2));
        assert_eq!(totals.cancelled, 1);
        assert_eq!(totals.unexpected.get("stream"), Some(&1));
        assert_eq!(totals.unexpected.get("timeout"), Some(&1));
        assert_eq!((totals.prompt_tokens, totals.cached_tokens), (100, 40));
        assert_eq!(tally.kills(), 1);
        // A kill is a restart once its replica is back (a restart can fail).
        assert_eq!(tally.restarts(), 0);
        tally.restarted();
        assert_eq!(tally.restarts(), 1);
    }

    /// vLLM leaves a miss's cached tokens out of its usage: once a response has said them, a
    /// usage without them counts as a miss, those before it too (they were held back until
    /// then: a cold start's misses counted nowhere); a response without a usage counts
    /// nowhere.
    #[test]
    fn a_usage_without_cached_tokens_is_a_miss_once_they_were_reported() {
        let tally = Tally::default();
        let sent = Instant::now();
        let miss = Success { prompt_tokens: 100, usage: true, ..Success::default() };
        let hit = Success { prompt_tokens: 100, cached_tokens: Some(90), usage: true, ..Success::default() };
        let no_usage = Success { prompt_tokens: 100, ..Success::default() };
        for ok in [miss.clone(), hit, miss, no_usage] {
            tally.finished(sent, Some("a"), &Ok(ok));
        }
        let totals = tally.totals();
        assert_eq!((totals.prompt_tokens, totals.cached_tokens), (300, 90));
        // A replica that never says them tells nothing of its misses.
        let silent = Tally::default();
        silent.finished(
            sent,
            Some("a"),
            &Ok(Success { prompt_tokens: 100, usage: true, ..Success::default() }),
        );
        assert_eq!((silent.totals().prompt_tokens, silent.totals().unreported_prompt_tokens), (0, 100));
    }

    /// Regression: a response without the router's prediction header counted as predicting
    /// 0 tokens, its prompt tokens kept in the denominator, biasing the rate low.
    #[test]
    fn the_predicted_hit_rate_leaves_out_responses_without_a_prediction() {
        let tally = Tally::default();
        let sent = Instant::now();
        let predicted = Success {
            prompt_tokens: 100,
            cached_tokens: Some(40),
            predicted_cached_tokens: Some(50),
            ..Success::default()
        };
        let unpredicted = Success { prompt_tokens: 300, cached_tokens: Some(40), ..Success::default() };
        tally.finished(sent, Some("a"), &Ok(predicted));
        tally.finished(sent, Some("a"), &Ok(unpredicted));
        let (hit, predicted) = crate::soak::report::window_rates(&Totals::default(), &tally.totals());
        assert_eq!((hit, predicted), (Some(80.0 / 400.0), Some(0.5)));
    }
}
