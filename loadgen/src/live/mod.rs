//! Live runs: a workload sent as real HTTP requests to a router (or a single replica),
//! measured per request and fleet-wide.
//!
//! Requests go out at the trace's timestamps (divided by a speed-up), at a seeded Poisson
//! rate, or closed-loop at a fixed concurrency ([`Arrivals`]); in-flight requests are bounded
//! by a semaphore, and so is the run's length ([`LiveConfig::max_duration`]). An open-loop
//! request that waits for a slot is late: its intended send is kept, so the report has
//! latencies from it beside those from the actual send. A prompt goes as the workload's
//! token ids (no tokenizer involved), or as text to the completions, chat, Messages or
//! Responses API ([`PromptFormat`]), with its output length as the most tokens to generate.
//! Before and after the run the replicas' and the target's `/metrics` are read, so the
//! [`LiveReport`] has the fleet's realized hit rate and per-replica prompt tokens as counter
//! deltas beside what the responses said.
//!
//! - [`client`]: one measured request (SSE parsing, TTFT, usage, router headers).
//! - [`scrape`]: Prometheus counters before and after.
//! - [`report`]: aggregation into a [`LiveReport`].

pub mod client;
pub mod report;
pub mod scrape;

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use http::HeaderValue;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rand::SeedableRng;
use rand::rngs::StdRng;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use client::{Client, ErrorKind, PromptFormat, Success};
pub use report::{HitRateSource, LiveReport, Percentiles, ReplicaShare, RequestRecord};

use crate::workload::{Request, Trace, after_poisson_gap, arrivals_at};

/// When requests are sent.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrivals {
    /// In the trace's order, at its timestamps divided by `speedup` counted from its first
    /// (never before the request listed before: [`Trace::arrivals_at`]).
    Trace { speedup: f64 },
    /// A Poisson process of `rate` requests per second, seeded; the trace gives the order.
    Poisson { rate: f64, seed: u64 },
    /// `concurrency` requests always in flight, each sent when another finishes.
    Closed { concurrency: usize },
}

/// What to run.
#[derive(Clone, Debug)]
pub struct LiveConfig {
    /// Base URL of the router or replica the completions go to (`http://host:port`).
    pub target: String,
    /// Base URLs of every replica behind it, for their `/metrics` (may be empty).
    pub replicas: Vec<String>,
    /// The `model` of every request.
    pub model: String,
    pub arrivals: Arrivals,
    /// Stream responses (SSE with `include_usage`), measuring TTFT; else one JSON answer.
    pub stream: bool,
    /// How prompts are written: token ids, or text the fleet tokenizes.
    pub prompt: PromptFormat,
    /// Most requests in flight at once; an open-loop request waits for a slot.
    pub max_in_flight: usize,
    /// Longest a request may take, body included.
    pub request_timeout: Duration,
    pub connect_timeout: Duration,
    /// No request is sent after this long.
    pub max_duration: Option<Duration>,
    /// Send at most this many requests of the workload.
    pub max_requests: Option<usize>,
    /// Show a progress bar (only ever drawn when stderr is a terminal).
    pub progress: bool,
    /// The report's label, shown on the progress bar too.
    pub label: String,
    /// `Authorization` of every completion (a router's or replica's `--api-key`), marked
    /// sensitive: its `Debug` does not show it.
    pub authorization: Option<HeaderValue>,
    /// HTTPS to an `https://` target ([`kvroute_proto::serve::client_config`]); `None`: the
    /// system's authorities, no client certificate.
    pub tls: Option<Arc<tokio_rustls::rustls::ClientConfig>>,
}

impl LiveConfig {
    /// A config with sensible defaults for `target`.
    pub fn new(target: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            target: target.into(),
            replicas: Vec::new(),
            model: model.into(),
            arrivals: Arrivals::Trace { speedup: 1.0 },
            stream: true,
            prompt: PromptFormat::Ids,
            max_in_flight: 256,
            request_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(2),
            max_duration: None,
            max_requests: None,
            progress: true,
            label: "live".into(),
            authorization: None,
            tls: None,
        }
    }
}

impl LiveConfig {
    /// The run's TLS: its own, or the system's authorities.
    pub fn tls(&self) -> Arc<tokio_rustls::rustls::ClientConfig> {
        self.tls.clone().unwrap_or_else(kvroute_proto::serve::system_client_config)
    }
}

/// Why a live run could not start.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error("the speed-up must be a positive, finite number, got {0}")]
    Speedup(f64),
    #[error("the Poisson rate must be a positive, finite number, got {0}")]
    Rate(f64),
    #[error(
        "the concurrency and the in-flight limit must be at least 1 (the limit at most {})",
        Semaphore::MAX_PERMITS
    )]
    Concurrency,
    #[error("--concurrency {concurrency} is more than --max-in-flight {limit}; raise that too")]
    ConcurrencyOverLimit { concurrency: usize, limit: usize },
    #[error("the target {0:?} is not an http:// or https:// URL")]
    Target(String),
    #[error("the request timeout must be longer than zero (every request would time out)")]
    Timeout,
    #[error("at {0} the requests would be sent past the longest wait a run can hold")]
    Schedule(String),
}

/// Sends `trace` (its first `max_requests`) as `config` says and reports what happened.
/// Cancelling `shutdown` stops sending and fails the requests in flight as `cancelled`.
pub async fn run(
    trace: &Trace,
    config: &LiveConfig,
    shutdown: CancellationToken,
) -> Result<LiveReport, LiveError> {
    validate(config)?;
    let requests = &trace.requests[..config.max_requests.unwrap_or(usize::MAX).min(trace.len())];
    let schedule = schedule(requests, config.arrivals)?;
    let client =
        Client::with_tls(config.connect_timeout, config.tls()).authorized(config.authorization.clone());
    let before = scrape::snapshot(&client, &config.target, &config.replicas).await;

    let bar = progress_bar(config, requests.len());
    let (tx, rx) = mpsc::channel(1024);
    let collector = tokio::spawn(collect(rx, bar.clone()));
    let sender = Sender {
        client: client.clone(),
        config: Arc::new(config.clone()),
        start: Instant::now(),
        tx,
        shutdown: shutdown.clone(),
    };
    // A deadline past what an `Instant` holds is no deadline.
    let deadline = config.max_duration.and_then(|d| sender.start.checked_add(d));
    let tracker = TaskTracker::new();
    match config.arrivals {
        Arrivals::Trace { .. } | Arrivals::Poisson { .. } => {
            open_loop(&sender, &tracker, requests, &schedule, deadline).await;
        }
        Arrivals::Closed { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            let requests: Arc<[Request]> = requests.into();
            for _ in 0..concurrency {
                let (sender, next, requests) = (sender.clone(), next.clone(), requests.clone());
                tracker.spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let past = deadline.is_some_and(|d| Instant::now() >= d);
                        if i >= requests.len() || past || sender.shutdown.is_cancelled() {
                            break;
                        }
                        sender.send(i, None, &requests[i]).await;
                    }
                });
            }
        }
    }
    tracker.close();
    tracker.wait().await;
    drop(sender);
    let records = collector.await.unwrap_or_else(|e| {
        tracing::error!(error = %e, "the progress collector failed; the report has no requests");
        Vec::new()
    });
    bar.finish_and_clear();
    let after = scrape::snapshot(&client, &config.target, &config.replicas).await;
    let mut report = LiveReport::new(
        config.label.clone(),
        config.target.clone(),
        records,
        &config.replicas,
        &before,
        &after,
    );
    report.interrupted = shutdown.is_cancelled();
    Ok(report)
}

/// Checks `config` before a run (also done by [`run`]).
pub fn validate(config: &LiveConfig) -> Result<(), LiveError> {
    if !(config.target.starts_with("http://") || config.target.starts_with("https://")) {
        return Err(LiveError::Target(config.target.clone()));
    }
    if config.max_in_flight == 0 || config.max_in_flight > Semaphore::MAX_PERMITS {
        return Err(LiveError::Concurrency);
    }
    if config.request_timeout.is_zero() {
        return Err(LiveError::Timeout);
    }
    match config.arrivals {
        Arrivals::Trace { speedup } if !(speedup.is_finite() && speedup > 0.0) => {
            Err(LiveError::Speedup(speedup))
        }
        Arrivals::Poisson { rate, .. } if !(rate.is_finite() && rate > 0.0) => Err(LiveError::Rate(rate)),
        Arrivals::Closed { concurrency: 0 } => Err(LiveError::Concurrency),
        // Past the limit, the run would quietly be a smaller one.
        Arrivals::Closed { concurrency } if concurrency > config.max_in_flight => {
            Err(LiveError::ConcurrencyOverLimit { concurrency, limit: config.max_in_flight })
        }
        _ => Ok(()),
    }
}

/// When each request is due, from the start of the run (open loop; empty in a closed loop):
/// the trace's arrivals over the speed-up, or a seeded Poisson process. A schedule whose
/// times overflow (a tiny speed-up or rate) is an error, not a run that sends everything at
/// once or panics.
fn schedule(requests: &[Request], arrivals: Arrivals) -> Result<Vec<Duration>, LiveError> {
    let last = |at: &[Duration]| at.iter().max().copied().unwrap_or_default();
    let at = match arrivals {
        Arrivals::Trace { speedup } => {
            // From the first request: a trace cut from a longer one starts at once.
            let too_long = || LiveError::Schedule(format!("speed-up {speedup}"));
            let arrivals = arrivals_at(requests, speedup).ok_or_else(too_long)?;
            let first = arrivals.first().copied().unwrap_or_default();
            let at: Vec<Duration> = arrivals.into_iter().map(|a| a - first).collect();
            Instant::now().checked_add(last(&at)).ok_or_else(too_long)?;
            at
        }
        Arrivals::Poisson { rate, seed } => {
            let too_long = || LiveError::Schedule(format!("rate {rate}/s"));
            let mut rng = StdRng::seed_from_u64(seed);
            let mut t = Duration::ZERO;
            let mut at = Vec::with_capacity(requests.len());
            for _ in requests {
                t = after_poisson_gap(&mut rng, t, rate).ok_or_else(too_long)?;
                at.push(t);
            }
            Instant::now().checked_add(t).ok_or_else(too_long)?;
            at
        }
        Arrivals::Closed { .. } => Vec::new(),
    };
    Ok(at)
}

/// Sends `requests[i]` at `start + at[i]`, each on its own task once a slot is free. `at[i]`
/// is recorded as the request's intended send time, so a request that waited for a slot (or
/// for a late timer) is measured from when it should have gone out, not only from when it
/// did: without that, a saturated client hides the queueing it causes (coordinated
/// omission).
async fn open_loop(
    sender: &Sender,
    tracker: &TaskTracker,
    requests: &[Request],
    times: &[Duration],
    deadline: Option<Instant>,
) {
    let slots = Arc::new(Semaphore::new(sender.config.max_in_flight));
    // `schedule` checked the last time fits an `Instant` a moment before `start`.
    let due_before = |at: Duration, end: Option<Instant>| {
        sender.start.checked_add(at).is_some_and(|when| end.is_none_or(|end| when < end))
    };
    for ((i, request), &at) in requests.iter().enumerate().zip(times) {
        if !due_before(at, deadline) {
            break;
        }
        let when = sender.start + at;
        // The wait for a free slot ends at the run's deadline too: with every slot held by
        // a stalled fleet, the requests due before it would go out long after.
        let due = async {
            tokio::time::sleep_until(when.into()).await;
            slots.clone().acquire_owned().await
        };
        let permit = tokio::select! {
            biased;
            () = sender.shutdown.cancelled() => break,
            () = until(deadline) => {
                // Those due before the run's end that no slot freed for are counted, not
                // left out of the report: under overload, the most delayed of all.
                let unsent = times.iter().enumerate().skip(i).take_while(|(_, at)| due_before(**at, deadline));
                for (j, &at) in unsent {
                    sender.unsent(j, at).await;
                }
                break;
            }
            permit = due => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let (sender, request) = (sender.clone(), request.clone());
        tracker.spawn(async move {
            sender.send(i, Some(at), &request).await;
            drop(permit);
        });
    }
}

/// Sleeps until `deadline`, or for ever without one.
pub(crate) async fn until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
        None => std::future::pending().await,
    }
}

/// What every request task needs.
#[derive(Clone)]
struct Sender {
    client: Client,
    config: Arc<LiveConfig>,
    start: Instant,
    tx: mpsc::Sender<RequestRecord>,
    shutdown: CancellationToken,
}

impl Sender {
    /// Sends `request` now, `intended` being when the schedule meant it to go (open loop).
    async fn send(&self, index: usize, intended: Option<Duration>, request: &Request) {
        let config = &self.config;
        let body = client::request_body(&config.model, request, config.stream, config.prompt);
        let sent = self.start.elapsed();
        let outcome = tokio::select! {
            outcome = self.client.complete(
                &config.target, body, config.stream, request.input_len as u64, config.request_timeout,
            ) => outcome,
            () = self.shutdown.cancelled() => Err(ErrorKind::Cancelled),
        };
        // The collector outlives every sender; a closed channel means it failed, and said so.
        let _ = self.tx.send(RequestRecord { index, intended, sent, outcome }).await;
    }

    /// Records request `index`, due at `intended`, as never sent ([`ErrorKind::Unsent`]).
    async fn unsent(&self, index: usize, intended: Duration) {
        let sent = self.start.elapsed();
        let _ = self
            .tx
            .send(RequestRecord { index, intended: Some(intended), sent, outcome: Err(ErrorKind::Unsent) })
            .await;
    }
}

/// Gathers records and keeps the progress bar's hit rate current.
async fn collect(mut rx: mpsc::Receiver<RequestRecord>, bar: ProgressBar) -> Vec<RequestRecord> {
    let mut records = Vec::new();
    let (mut prompt, mut cached, mut failed) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    while let Some(record) = rx.recv().await {
        match &record.outcome {
            Ok(s) => {
                prompt += s.prompt_tokens;
                cached += s.cached_tokens.unwrap_or(0);
            }
            Err(_) => failed += 1,
        }
        records.push(record);
        bar.inc(1);
        let rate = if prompt > 0 { 100.0 * cached as f64 / prompt as f64 } else { 0.0 };
        let per_s = records.len() as f64 / start.elapsed().as_secs_f64().max(1e-3);
        bar.set_message(format!("{per_s:.1} req/s  hit {rate:.1}%  errors {failed}"));
    }
    misses_as_zero(&mut records);
    records
}

/// Once any response of the run said its cached tokens, one whose usage does not is a miss
/// (vLLM leaves them out when there are none), not left out of the hit rate (which would
/// count only hits).
fn misses_as_zero(records: &mut [RequestRecord]) {
    let reports = records.iter().any(|r| r.outcome.as_ref().is_ok_and(|s| s.cached_tokens.is_some()));
    for s in records.iter_mut().filter_map(|r| r.outcome.as_mut().ok()) {
        s.cached_tokens = s.cached_tokens_given(reports);
    }
}

fn progress_bar(config: &LiveConfig, len: usize) -> ProgressBar {
    if !config.progress || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len as u64), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template("{prefix:>14} [{bar:30}] {pos}/{len}  {msg}  {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(config.label.clone());
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(millis: u64) -> Request {
        let arrival = Duration::from_millis(millis);
        Request { arrival, input_len: 1, output_len: 1, hash_ids: vec![1], segments: Vec::new() }
    }

    /// vLLM leaves a miss's cached tokens out of its usage: once any response of the run said
    /// them, a usage without them is a miss (0), not left out of the hit rate; a response with
    /// no usage, or a run where none said them, stays unknown.
    #[test]
    fn a_usage_without_cached_tokens_is_a_miss_once_any_reported_them() {
        let record = |cached_tokens, usage| RequestRecord {
            index: 0,
            intended: None,
            sent: Duration::ZERO,
            outcome: Ok(Success { prompt_tokens: 1000, cached_tokens, usage, ..Success::default() }),
        };
        let cached = |records: &[RequestRecord]| -> Vec<Option<u64>> {
            records.iter().map(|r| r.outcome.as_ref().unwrap().cached_tokens).collect()
        };
        let mut run =
            vec![record(None, true), record(Some(900), true), record(None, true), record(None, false)];
        misses_as_zero(&mut run);
        assert_eq!(cached(&run), [Some(0), Some(900), Some(0), None]);
        let mut silent = vec![record(None, true), record(None, false)];
        misses_as_zero(&mut silent);
        assert_eq!(cached(&silent), [None, None]);
    }

    /// A trace's requests go out from its first arrival (one cut from the middle of a longer
    /// trace starts at once), in its order, never before the one listed before them.
    #[test]
    fn a_trace_is_sent_from_its_first_arrival_in_its_order() {
        let ms = Duration::from_millis;
        let requests = [at(10_000), at(12_000), at(11_000), at(14_000)];
        let got = schedule(&requests, Arrivals::Trace { speedup: 2.0 }).unwrap();
        assert_eq!(got, [ms(0), ms(1000), ms(1000), ms(2000)]);
        assert!(schedule(&requests, Arrivals::Trace { speedup: 1e-300 }).is_err());
    }

    /// An in-flight limit past what a semaphore holds ("unlimited") is refused, not a panic.
    #[test]
    fn an_in_flight_limit_past_a_semaphores_is_refused() {
        let mut config = LiveConfig::new("http://127.0.0.1:1".to_owned(), "m");
        assert!(validate(&config).is_ok());
        config.max_in_flight = usize::MAX;
        assert!(matches!(validate(&config), Err(LiveError::Concurrency)));
        // A closed loop wider than the limit would quietly run narrower.
        config.max_in_flight = 256;
        config.arrivals = Arrivals::Closed { concurrency: 512 };
        assert!(matches!(
            validate(&config),
            Err(LiveError::ConcurrencyOverLimit { concurrency: 512, limit: 256 })
        ));
        config.arrivals = Arrivals::Closed { concurrency: 256 };
        assert!(validate(&config).is_ok());
        // A zero timeout would fail every request and still write a report.
        config.request_timeout = Duration::ZERO;
        assert!(matches!(validate(&config), Err(LiveError::Timeout)));
    }

    /// `max_duration` ends the sending even while every slot is held (a fleet that accepts
    /// and never answers): requests due before it are not sent after it as slots free up.
    #[tokio::test]
    async fn nothing_is_sent_past_the_runs_length_while_slots_are_full() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = format!("http://{}", silent.local_addr().unwrap());
        // Completions are held unanswered; the run's scrapes of the target get a 404.
        let held = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut conns = Vec::new();
            while let Ok((mut conn, _)) = silent.accept().await {
                let mut head = [0u8; 4];
                if conn.read_exact(&mut head).await.is_ok() && &head == b"GET " {
                    let _ = conn.write_all(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n").await;
                }
                conns.push(conn);
            }
        });
        let config = LiveConfig {
            max_in_flight: 1,
            request_timeout: Duration::from_millis(300),
            max_duration: Some(Duration::from_millis(100)),
            arrivals: Arrivals::Trace { speedup: 1.0 },
            ..LiveConfig::new(target, "m")
        };
        let trace = Trace::new((0..10).map(|_| at(0)).collect());
        let report = run(&trace, &config, CancellationToken::new()).await.unwrap();
        held.abort();
        assert!(!report.records.is_empty());
        for r in report.records.iter().filter(|r| r.outcome != Err(ErrorKind::Unsent)) {
            assert!(r.sent < Duration::from_millis(100), "request {} sent at {:?}", r.index, r.sent);
        }
        // Every request was due before the run's end: the nine that found no slot are
        // counted as never sent, not left out.
        assert_eq!(report.requests, 10);
        assert_eq!(report.errors.get("unsent"), Some(&9));
        assert!(
            report
                .records
                .iter()
                .filter(|r| r.outcome == Err(ErrorKind::Unsent))
                .all(|r| r.lateness().is_none())
        );
    }
}
