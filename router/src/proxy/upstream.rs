//! The HTTP side of each replica, as the proxy sees it: load the router has put on it, its
//! health, whether it is draining (an operator's word) and whether it is serving (the
//! platform's: Kubernetes readiness, from discovery).
//!
//! Load is counted at decision time: `in_flight` rises when a request routed on its prompt is
//! decided (or its retry's replica picked), in one step with the check that the replica has
//! room ([`Upstream::try_begin`]; other requests are counted as they are sent, the check
//! made when their replica was chosen), and falls when its response ends (or the client
//! goes away), and `sequences` with it by the request's
//! sequences (its prompts times its `n`: what the replica runs and reports); `pending_prefill` holds the uncached prompt
//! tokens of requests whose prefill is not known to be over, which is the work standing
//! between a new request and its first token ([`PendingPrefill`] says when each is let go:
//! at the first output of a stream, when the replica's events store a whole answer's prompt,
//! else at the answer's end); `recent_prompt_tokens` is a decayed
//! sum of the prompt tokens sent to it ([`RecentTokens`]), the longer-run share of the work it
//! has been given.
//!
//! Health combines an active check (`GET /health` every `--health-interval-ms`) with passive
//! outlier ejection: `--eject-after` consecutive failures eject the replica for
//! `--ejection-ms`; after that it is eligible again and a success makes it healthy (a failure
//! ejects it again at once).
//! - Failures: connection refused or reset before an answer, the first-byte timeout, a 5xx
//!   head other than 503, and a body the replica broke off or left silent past the idle
//!   timeout.
//! - Successes: an answer whose body the replica sent whole (so one that sends its head and
//!   then hangs is not cleared by it).
//! - Neither: a 503 (a refusal under load: were it counted, a load spike would eject the
//!   fleet one replica after another) and a body its client left.
//!
//! When every replica that is up is ejected, the ejected ones are tried anyway
//! ([`verdicts`], for routed requests, other `/v1/*` requests and remote tokenization):
//! ejection steers traffic away from outliers, it never empties the fleet.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvroute_proto::ReplicaId;
use tokio::time::Instant;

use super::waiters::Waiters;

use crate::policy::{Load, RecentTokens, ReportMark};

/// Why a replica is not eligible right now, if it is not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ineligible {
    Unhealthy,
    Ejected,
    Draining,
    /// Discovery says the replica is not serving (its endpoint is not Ready).
    NotServing,
    Saturated,
    /// The request names a LoRA adapter the replica lacks: one loaded through the router
    /// that it is not known to have ([`crate::proxy::lora::catch_up`]), or another that its
    /// last list of models left out ([`Upstream::set_listed_adapters`]).
    NoAdapter,
}

/// The LoRA adapter a request is for, and how a replica is known to have it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adapter<'a> {
    /// Loaded through the router (`--lora-updates`): on the replicas it was given to or
    /// that list it ([`Upstream::has_adapter`]).
    Loaded(&'a str),
    /// Any other (in `--lora-adapters`, or learned from the replicas' lists): on every
    /// replica but those whose last list of models leaves it out. A replica that lists
    /// nothing (SGLang's, one that wants an API key, one not yet checked) may have it; and
    /// while no replica that lists it is up, any may (vLLM's LoRA resolvers load an adapter
    /// at its first request).
    Listed(&'a str),
}

impl Ineligible {
    pub fn as_str(self) -> &'static str {
        match self {
            Ineligible::Unhealthy => "unhealthy",
            Ineligible::Ejected => "ejected",
            Ineligible::Draining => "draining",
            Ineligible::NotServing => "not_serving",
            Ineligible::Saturated => "saturated",
            Ineligible::NoAdapter => "lora_adapter_missing",
        }
    }
}

/// The APIs whose answers say their cached tokens each in their own way ([`usage_dialect`]).
const USAGE_DIALECTS: usize = 4;

/// Which API's usage an answer to `path` carries: completions and chat (and every other path),
/// Responses (a stored response fetched too), Messages, or SGLang's `/generate`.
pub fn usage_dialect(path: &str) -> usize {
    let under =
        |prefix: &str| path.strip_prefix(prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'));
    match () {
        () if under("/v1/responses") => 1,
        () if under("/v1/messages") => 2,
        () if under("/generate") => 3,
        () => 0,
    }
}

/// One replica's proxy-side state.
#[derive(Debug)]
pub struct Upstream {
    /// Requests in flight (what `--max-in-flight-per-replica` bounds).
    in_flight: AtomicU32,
    /// Their sequences ([`Load::in_flight`]).
    sequences: AtomicU32,
    pending_prefill: AtomicU64,
    /// Prompt tokens sent lately, since `epoch`.
    recent: Mutex<RecentTokens>,
    epoch: Instant,
    /// Last `num_requests_waiting` the replica reported (via its metrics), if polled.
    reported_waiting: AtomicU32,
    /// See [`Load::others`].
    others: AtomicU32,
    consecutive_failures: AtomicU32,
    /// Active health checks failed since the last one passed.
    failed_checks: AtomicU32,
    /// Not yet failed as many health checks in a row as make it unhealthy (true until they
    /// say otherwise; [`Upstream::record_check`]).
    healthy: AtomicBool,
    /// Its last failed check was not answered in time: slow, not known to be down.
    late: AtomicBool,
    draining: AtomicBool,
    serving: AtomicBool,
    /// Set while `ejected_until` holds a time, so a decision checks a flag, not a lock and
    /// the clock, for each replica that is not ejected.
    ejected: AtomicBool,
    ejected_until: Mutex<Option<Instant>>,
    pub ejections: AtomicU64,
    /// Requests sent to the replica (each attempt of a retried request counts), counted as
    /// each is decided.
    pub requests: AtomicU64,
    /// Sequences ever sent to the replica ([`Upstream::report_mark`]).
    begun: AtomicU64,
    /// An answer of the replica's has said its cached tokens, for each API's usage
    /// ([`Upstream::cached_tokens`]).
    reports_cached: [AtomicBool; USAGE_DIALECTS],
    /// The LoRA adapters loaded through the router that the replica is known to have.
    adapters: Mutex<HashSet<String>>,
    /// The replica's process start time as its metrics page last said it
    /// ([`Upstream::note_start`]).
    started: Mutex<Option<f64>>,
    /// The LoRA adapters the replica listed in `/v1/models` at the last health check that
    /// read its list; `None` until one did.
    listed_adapters: Mutex<Option<HashSet<String>>>,
    /// The fields of the served model's card in the replica's `/v1/models` (besides its id
    /// and parent), as last listed.
    card: Mutex<Option<Arc<serde_json::Map<String, serde_json::Value>>>>,
    /// Told when a request here ends or the replica comes back ([`Waiters`]), as `id`.
    waiters: Arc<Waiters>,
    id: ReplicaId,
}

impl Default for Upstream {
    fn default() -> Self {
        Self {
            in_flight: AtomicU32::new(0),
            sequences: AtomicU32::new(0),
            pending_prefill: AtomicU64::new(0),
            recent: Mutex::new(RecentTokens::default()),
            epoch: Instant::now(),
            reported_waiting: AtomicU32::new(0),
            others: AtomicU32::new(0),
            consecutive_failures: AtomicU32::new(0),
            failed_checks: AtomicU32::new(0),
            healthy: AtomicBool::new(true),
            late: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            serving: AtomicBool::new(true),
            ejected: AtomicBool::new(false),
            ejected_until: Mutex::new(None),
            ejections: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            reports_cached: Default::default(),
            begun: AtomicU64::new(0),
            adapters: Mutex::default(),
            started: Mutex::default(),
            card: Mutex::default(),
            listed_adapters: Mutex::default(),
            waiters: Arc::default(),
            id: ReplicaId::default(),
        }
    }
}

impl Upstream {
    /// Replica `id`'s state, whose ended requests (and return) wake `waiters`.
    pub fn waking(waiters: Arc<Waiters>, id: ReplicaId) -> Self {
        Self { waiters, id, ..Self::default() }
    }

    pub fn load(&self) -> Load {
        self.load_at(Instant::now())
    }

    /// [`Self::load`] as of `now` (one clock reading serves a whole decision).
    pub fn load_at(&self, now: Instant) -> Load {
        Load {
            in_flight: self.sequences.load(Ordering::Relaxed),
            pending_prefill_tokens: self.pending_prefill.load(Ordering::Relaxed),
            reported_waiting: self.reported_waiting.load(Ordering::Relaxed),
            others: self.others.load(Ordering::Relaxed),
            recent_prompt_tokens: self.recent().tokens(now.saturating_duration_since(self.epoch)),
        }
    }

    /// The replica it is the upstream of.
    pub fn id(&self) -> ReplicaId {
        self.id
    }

    /// Requests in flight (each counts once, whatever its sequences).
    pub fn requests_in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Whether a request may take a place under `max_in_flight` (`--max-in-flight-per-replica`):
    /// the requests in flight, and the rooms held for woken requests other than the deciding
    /// one ([`Waiters::held_for_others`]), leave one.
    pub fn has_room(&self, max_in_flight: u32) -> bool {
        let taken =
            self.in_flight.load(Ordering::Relaxed).saturating_add(self.waiters.held_for_others(self.id));
        taken < max_in_flight
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, RecentTokens> {
        self.recent.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the replica may receive a new request now.
    pub fn eligibility(&self, max_in_flight: u32) -> Result<(), Ineligible> {
        self.eligibility_with(max_in_flight, false)
    }

    /// [`Self::eligibility`]; `lenient` (nothing else is up: [`verdicts_for`]) sets aside
    /// its ejection, and its health when its checks only went unanswered in time.
    fn eligibility_with(&self, max_in_flight: u32, lenient: bool) -> Result<(), Ineligible> {
        if self.draining.load(Ordering::Relaxed) {
            return Err(Ineligible::Draining);
        }
        if !self.serving.load(Ordering::Relaxed) {
            return Err(Ineligible::NotServing);
        }
        if !lenient && self.is_ejected() {
            return Err(Ineligible::Ejected);
        }
        let passes = self.healthy.load(Ordering::Relaxed) || (lenient && self.late.load(Ordering::Relaxed));
        if !passes {
            return Err(Ineligible::Unhealthy);
        }
        if !self.has_room(max_in_flight) {
            return Err(Ineligible::Saturated);
        }
        Ok(())
    }

    fn is_ejected(&self) -> bool {
        if !self.ejected.load(Ordering::Acquire) {
            return false;
        }
        let mut until = self.ejected_until.lock().unwrap_or_else(|e| e.into_inner());
        match *until {
            Some(t) if Instant::now() < t => true,
            Some(_) => {
                *until = None;
                self.ejected.store(false, Ordering::Release);
                false
            }
            None => false,
        }
    }

    /// Counts a request of `sequences` sequences with `prompt_tokens` tokens,
    /// `prefill_tokens` of them uncached, sent to this replica; the guard undoes all but the
    /// recent prompt tokens, which only decay.
    pub fn begin(
        self: &std::sync::Arc<Self>,
        sequences: u32,
        prefill_tokens: u64,
        prompt_tokens: u64,
    ) -> LoadGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.counted(sequences, prefill_tokens, prompt_tokens)
    }

    /// [`Self::begin`], only while the replica [has room](Self::has_room) under
    /// `max_in_flight`: the room is taken in one step with the check, so two requests deciding
    /// at once cannot both take the last one. `None`: there is none.
    pub fn try_begin(
        self: &std::sync::Arc<Self>,
        max_in_flight: u32,
        sequences: u32,
        prefill_tokens: u64,
        prompt_tokens: u64,
    ) -> Option<LoadGuard> {
        let held = self.waiters.held_for_others(self.id);
        let room = |n: u32| (n.saturating_add(held) < max_in_flight).then_some(n + 1);
        self.in_flight.fetch_update(Ordering::Relaxed, Ordering::Relaxed, room).ok()?;
        // The room its hold kept is taken: for the moment between the two, it counted twice,
        // and a request deciding then may have found no room that is there (told, it decides
        // again).
        if self.waiters.took(self.id) && self.has_room(max_in_flight) {
            self.waiters.freed(self.id);
        }
        Some(self.counted(sequences, prefill_tokens, prompt_tokens))
    }

    /// The rest of [`Self::begin`], its request counted in `in_flight`.
    fn counted(
        self: &std::sync::Arc<Self>,
        sequences: u32,
        prefill_tokens: u64,
        prompt_tokens: u64,
    ) -> LoadGuard {
        self.sequences.fetch_add(sequences, Ordering::Relaxed);
        self.begun.fetch_add(u64::from(sequences), Ordering::Relaxed);
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.pending_prefill.fetch_add(prefill_tokens, Ordering::Relaxed);
        self.recent().add(self.epoch.elapsed(), prompt_tokens);
        let prefill = Arc::new(PendingPrefill {
            upstream: self.clone(),
            tokens: AtomicU64::new(prefill_tokens),
            rank: std::sync::OnceLock::new(),
        });
        LoadGuard { upstream: self.clone(), sequences, prefill, rank: None }
    }

    /// The cached tokens an answer's `usage` shows: those it says, or none (0) when it counts
    /// the prompt without them and the replica has said them before (vLLM, with
    /// `--enable-prompt-tokens-details`, leaves them out when there are none; a replica that
    /// never says them, such a vLLM without the flag, tells nothing). A replica's misses are
    /// known from its first answer that says its cached tokens, for each API apart: vLLM's
    /// Responses API says them always, its chat completions only with the flag, and SGLang's
    /// `/generate` always, its chat only with `--enable-cache-report` (`path`: the request's).
    pub fn cached_tokens(&self, usage: super::body::Usage, path: &str) -> Option<u64> {
        self.cached_tokens_in(usage, usage_dialect(path))
    }

    /// [`Upstream::cached_tokens`] of an answer in `dialect` ([`usage_dialect`]).
    pub fn cached_tokens_in(&self, usage: super::body::Usage, dialect: usize) -> Option<u64> {
        let Some(reports) = self.reports_cached.get(dialect) else { return usage.cached_tokens };
        if usage.cached_tokens.is_some() {
            if !reports.load(Ordering::Relaxed) {
                reports.store(true, Ordering::Relaxed);
            }
            return usage.cached_tokens;
        }
        (usage.counted && reports.load(Ordering::Relaxed)).then_some(0)
    }

    pub fn record_success(&self) {
        self.consecutive_failures.store(0, Ordering::Relaxed);
    }

    /// Records a failure; returns true if it ejected the replica.
    pub fn record_failure(&self, eject_after: u32, ejection: Duration) -> bool {
        let failures = self.consecutive_failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures >= eject_after {
            let mut until = self.ejected_until.lock().unwrap_or_else(|e| e.into_inner());
            // An ejection whose time is up (not yet seen by a decision) is over.
            if until.is_none_or(|t| Instant::now() >= t) {
                *until = Some(Instant::now() + ejection);
                self.ejected.store(true, Ordering::Release);
                self.ejections.fetch_add(1, Ordering::Relaxed);
                // After the ejection one more failure ejects again; one success clears it.
                self.consecutive_failures.store(eject_after.saturating_sub(1), Ordering::Relaxed);
                // Out, others may be eligible in its stead (the ejected ones, when none is up).
                self.waiters.wake_all();
                // Requests waiting for room elsewhere may take it once it is back.
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    let waiters = self.waiters.clone();
                    runtime.spawn(async move {
                        tokio::time::sleep(ejection).await;
                        waiters.wake_all();
                    });
                }
                return true;
            }
        }
        false
    }

    /// Whether the replica is known to have `adapter` (loaded through the router).
    pub fn has_adapter(&self, adapter: &str) -> bool {
        self.adapters.lock().unwrap_or_else(PoisonError::into_inner).contains(adapter)
    }

    /// Whether the replica is known to lack `adapter`.
    pub fn lacks(&self, adapter: Adapter<'_>) -> bool {
        match adapter {
            Adapter::Loaded(name) => !self.has_adapter(name),
            Adapter::Listed(name) => self.lists(name) == Some(false),
        }
    }

    /// Whether the replica's last list names `adapter`; `None` when it has given none.
    fn lists(&self, adapter: &str) -> Option<bool> {
        let listed = self.listed_adapters.lock().unwrap_or_else(PoisonError::into_inner);
        listed.as_ref().map(|listed| listed.contains(adapter))
    }

    /// The LoRA adapters the replica listed last, sorted; `None` when its last healthy check
    /// read no list (it may have any), or before its first.
    pub fn listed_adapters(&self) -> Option<Vec<String>> {
        let listed = self.listed_adapters.lock().unwrap_or_else(PoisonError::into_inner);
        let mut listed: Vec<String> = listed.as_ref()?.iter().cloned().collect();
        listed.sort_unstable();
        Some(listed)
    }

    /// The LoRA adapters the replica lists now (the cards of its `/v1/models` with a parent),
    /// or `None` when a check of it read no list (it may have any).
    pub fn set_listed_adapters(&self, listed: Option<HashSet<String>>) {
        let mut was = self.listed_adapters.lock().unwrap_or_else(PoisonError::into_inner);
        // (A first list only narrows what the replica may have.)
        let changed = match (was.as_ref(), listed.as_ref()) {
            (Some(was), Some(listed)) => was != listed,
            (Some(_), None) => true,
            (None, _) => false,
        };
        *was = listed;
        drop(was);
        // Requests for an adapter it gained that waited for room elsewhere may go here now;
        // those for one it dropped, if it was the adapter's last lister, anywhere.
        if changed {
            self.waiters.wake_all();
        }
    }

    /// The adapters (loaded through the router) the replica is known to have, sorted.
    pub fn adapters(&self) -> Vec<String> {
        let mut adapters: Vec<String> =
            self.adapters.lock().unwrap_or_else(PoisonError::into_inner).iter().cloned().collect();
        adapters.sort_unstable();
        adapters
    }

    /// Notes the replica's process start time (`process_start_time_seconds`, on vLLM's
    /// metrics page): another than the last one noted is a restart, which lost the adapters
    /// loaded on it ([`Upstream::forget_adapters`]). True at a restart.
    pub fn note_start(&self, started: f64) -> bool {
        let mut was = self.started.lock().unwrap_or_else(PoisonError::into_inner);
        let restarted = was.is_some_and(|was| was != started);
        *was = Some(started);
        drop(was);
        if restarted {
            self.forget_adapters();
        }
        restarted
    }

    /// Forgets the adapters the replica was known to have (it may have restarted without
    /// them), for the catch-up to load them again ([`super::lora::catch_up`]; one still there
    /// answers "already loaded", and is marked again): an SGLang replica lists none, and was
    /// taken to have them for ever.
    pub fn forget_adapters(&self) {
        self.adapters.lock().unwrap_or_else(PoisonError::into_inner).clear();
    }

    /// Marks the replica as having `adapter`, or not.
    pub fn mark_adapter(&self, adapter: &str, has: bool) {
        let mut adapters = self.adapters.lock().unwrap_or_else(PoisonError::into_inner);
        let gained = match has {
            true => adapters.insert(adapter.to_owned()),
            false => !adapters.remove(adapter),
        };
        drop(adapters);
        // Requests for the adapter that waited for room elsewhere may go here now.
        if has && gained {
            self.waiters.wake_all();
        }
    }

    /// The served model's card as the replica last listed it (its fields besides id and
    /// parent).
    pub fn card(&self) -> Option<Arc<serde_json::Map<String, serde_json::Value>>> {
        self.card.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub fn set_card(&self, card: serde_json::Map<String, serde_json::Value>) {
        *self.card.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(card));
    }

    /// (A change either way wakes the requests waiting for room: back, it may take them; out,
    /// others may be eligible in its stead, as the ejected and late are when none is up.)
    pub fn set_healthy(&self, healthy: bool) {
        if self.healthy.swap(healthy, Ordering::Relaxed) != healthy {
            self.waiters.wake_all();
        }
    }

    /// Records an active health check: `unhealthy_after` failed in a row make the replica
    /// unhealthy, one passed makes it healthy. Returns whether it is healthy now.
    pub fn record_check(&self, check: Check, unhealthy_after: u32) -> bool {
        let healthy = match check {
            Check::Passed => {
                self.failed_checks.store(0, Ordering::Relaxed);
                true
            }
            Check::Late | Check::Failed => {
                self.late.store(check == Check::Late, Ordering::Relaxed);
                let failed = self.failed_checks.fetch_add(1, Ordering::Relaxed).saturating_add(1);
                failed < unhealthy_after
            }
        };
        self.set_healthy(healthy);
        healthy
    }

    /// Whether its health checks have not failed enough in a row to make it unhealthy
    /// (whatever its ejection).
    pub fn passes_checks(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Out of health only because its checks went unanswered in time: routed to while no
    /// replica is healthy ([`verdicts_for`]).
    pub fn is_late(&self) -> bool {
        !self.healthy.load(Ordering::Relaxed) && self.late.load(Ordering::Relaxed)
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed) && !self.is_ejected()
    }

    /// (Either way, waking the requests waiting for room, as [`Upstream::set_healthy`].)
    pub fn set_draining(&self, draining: bool) {
        if self.draining.swap(draining, Ordering::Relaxed) != draining {
            self.waiters.wake_all();
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// (Either way, waking the requests waiting for room, as [`Upstream::set_healthy`].)
    pub fn set_serving(&self, serving: bool) {
        if self.serving.swap(serving, Ordering::Relaxed) != serving {
            self.waiters.wake_all();
        }
    }

    pub fn is_serving(&self) -> bool {
        self.serving.load(Ordering::Relaxed)
    }

    /// This router's sequences in flight, and ever sent, as a health check begins: what a
    /// report read after it can hold of this router's own ([`Upstream::set_reported`]).
    pub fn report_mark(&self) -> ReportMark {
        // `begun` first: a request begun between the two reads then counts twice as this
        // router's (others one short till the next check), never as nobody's.
        let begun = self.begun.load(Ordering::Relaxed);
        ReportMark { in_flight: self.sequences.load(Ordering::Relaxed), begun }
    }

    /// What the replica reports at a health check: requests waiting and running (`None`: it
    /// reported nothing, and its last report no longer counts). This router's share of it is
    /// at most what was in flight when the check began (`mark`) and what was sent since: the
    /// rest is others' work, never this router's own counted twice.
    pub fn set_reported(&self, report: Option<(u32, u32)>, mark: ReportMark) {
        let (waiting, running) = report.unwrap_or_default();
        self.reported_waiting.store(waiting, Ordering::Relaxed);
        let others = mark.others(waiting.saturating_add(running), self.begun.load(Ordering::Relaxed));
        self.others.store(others, Ordering::Relaxed);
    }
}

/// An active health check's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Check {
    /// A 2xx in time.
    Passed,
    /// No answer in time: the replica may be busy, not down.
    Late,
    /// Refused, broken off, or answered otherwise.
    Failed,
}

/// Why each of `upstreams` may not take a new request now (`None`: it may).
///
/// When no replica is up (healthy by its active checks, not ejected, not draining, serving,
/// not saturated), passive ejection is set aside, and so are failed health checks that only
/// went unanswered in time: ejection steers traffic away from outliers, and a fleet whose
/// `/health` answers late under load (vLLM's, at its peak) is busy, not down; neither must
/// leave nothing to try (as Envoy's panic threshold does). Replicas that are draining, not
/// serving, saturated, or whose checks were refused or failed stay out either way.
pub fn verdicts<'a>(
    upstreams: impl ExactSizeIterator<Item = &'a Upstream> + Clone,
    max_in_flight: u32,
) -> Vec<Option<Ineligible>> {
    verdicts_for(upstreams, max_in_flight, None)
}

/// [`verdicts`] for a request to `adapter`, a LoRA adapter: a replica that lacks it is out
/// ([`Upstream::lacks`]), and counts as down when ejection is set aside.
pub fn verdicts_for<'a>(
    upstreams: impl ExactSizeIterator<Item = &'a Upstream> + Clone,
    max_in_flight: u32,
    adapter: Option<Adapter<'_>>,
) -> Vec<Option<Ineligible>> {
    // An adapter that no replica up lists is any replica's to take or refuse: one that vLLM's
    // LoRA resolvers load at its first request, say, while the one that loaded it first is
    // draining or down (kept to it, its requests would be refused where another could load it).
    let adapter = adapter.filter(|a| match a {
        Adapter::Loaded(_) => true,
        Adapter::Listed(name) => upstreams.clone().any(|u| {
            u.lists(name) == Some(true)
                && matches!(u.eligibility_with(max_in_flight, false), Ok(()) | Err(Ineligible::Saturated))
        }),
    });
    let lacks = |u: &Upstream| adapter.is_some_and(|a| u.lacks(a)).then_some(Ineligible::NoAdapter);
    // A replica without the adapter is out whatever its load: saturated means one that could
    // take the request once it has room ([`super::queue`]).
    let judge = |u: &Upstream, lenient: bool| match u.eligibility_with(max_in_flight, lenient) {
        Ok(()) => lacks(u),
        Err(Ineligible::Saturated) => lacks(u).or(Some(Ineligible::Saturated)),
        Err(other) => Some(other),
    };
    let mut verdicts: Vec<Option<Ineligible>> = upstreams.clone().map(|u| judge(u, false)).collect();
    let none_up = verdicts.iter().all(|v| {
        matches!(
            v,
            Some(
                Ineligible::Ejected
                    | Ineligible::Unhealthy
                    | Ineligible::Draining
                    | Ineligible::NotServing
                    | Ineligible::NoAdapter
            )
        )
    });
    if none_up {
        for (verdict, upstream) in verdicts.iter_mut().zip(upstreams) {
            if matches!(verdict, Some(Ineligible::Ejected | Ineligible::Unhealthy)) {
                *verdict = judge(upstream, true);
            }
        }
    }
    verdicts
}

/// A request's share of a replica's load; dropping it releases everything still held.
#[derive(Debug)]
pub struct LoadGuard {
    upstream: Arc<Upstream>,
    sequences: u32,
    prefill: Arc<PendingPrefill>,
    /// The load on the data-parallel rank the request was sent to, if one was named.
    rank: Option<crate::index::RankGuard>,
}

impl LoadGuard {
    /// The replica the load is on.
    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    /// The data-parallel rank the request was sent to, if one was named.
    pub fn rank(&self) -> Option<u32> {
        self.rank.as_ref().map(crate::index::RankGuard::rank)
    }

    /// The request was sent to a data-parallel rank: its load there ends with this guard.
    pub fn hold_rank(&mut self, rank: crate::index::RankGuard) {
        self.prefill.on_rank(rank.ranks().clone(), rank.rank());
        self.rank = Some(rank);
    }

    /// The replica took the request (a success answer): its credits on the rank stand.
    pub fn keep_rank(&mut self) {
        if let Some(rank) = self.rank.as_mut() {
            rank.keep();
        }
    }

    /// The replica refused the request (an error answer): the credits only it made on the
    /// rank end now.
    pub fn withdraw_rank(&mut self) {
        if let Some(rank) = self.rank.as_mut() {
            rank.withdraw();
        }
    }

    /// The first response byte arrived: the prefill is done.
    pub fn prefill_done(&mut self) {
        self.prefill.release();
        if let Some(rank) = self.rank.as_mut() {
            rank.prefill_done();
        }
    }

    /// The request's `prompts` were prefilled on another replica, whence this one pulls them
    /// ([`super::disagg`]): what it computes of each is its last token.
    pub fn prefilled_elsewhere(&mut self, prompts: u32) {
        self.prefill.keep_at_most(u64::from(prompts.max(1)));
    }

    /// Tells the request's pending prefill to the rank it was sent to, to be released when
    /// the rank's events store its prompt ([`crate::index::RankGuard::tell_when_stored`]);
    /// false when it was sent to no rank.
    pub fn tell_when_rank_stored(&mut self) -> bool {
        match self.rank.as_mut() {
            Some(rank) => {
                rank.tell_when_stored(self.prefill.clone());
                true
            }
            None => false,
        }
    }

    /// The request's pending prefill, to be released when the replica's events show its
    /// prompt stored (an answer that is not streamed has its first byte only at its end).
    pub fn pending_prefill(&self) -> Arc<PendingPrefill> {
        self.prefill.clone()
    }
}

/// A request's prefill tokens in its replica's pending count, taken out once: at the
/// answer's first data (a Responses stream's first output), when the replica's events store
/// the prompt's last block ([`crate::index::OnStored`]), or when the request ends, whichever
/// comes first. The stored block is not waited for in a batch (a later prompt's last block
/// may lie inside an earlier one), a chat with media (its blocks end before the media), a
/// stream, a request with no prediction to credit (a stored
/// response's continuation, other paths), nor is it ever seen from a replica whose stream is
/// `FALLBACK`, nor before the answer's first data from one without events (`PREDICTED`: its
/// blocks are stored then): a whole answer of those holds its prefill until its end.
#[derive(Debug)]
pub struct PendingPrefill {
    upstream: Arc<Upstream>,
    tokens: AtomicU64,
    /// The data-parallel rank the request was sent to, whose pending prefill it is too.
    rank: std::sync::OnceLock<(Arc<crate::index::Ranks>, u32)>,
}

impl PendingPrefill {
    /// The prefill is `rank`'s of `ranks` too, until released.
    fn on_rank(&self, ranks: Arc<crate::index::Ranks>, rank: u32) {
        // Attached before anything is told to release it (so nothing does meanwhile); were
        // it released between the two steps, it would take from the rank what it had not
        // added yet (never below zero) rather than leave it counted for good.
        if self.rank.set((ranks, rank)).is_ok()
            && let Some((ranks, rank)) = self.rank.get()
        {
            ranks.add_prefill(*rank, self.tokens.load(Ordering::Acquire));
        }
    }

    fn release(&self) {
        self.keep_at_most(0);
    }

    /// Takes all but `n` of its tokens out of the counts (none if it has no more).
    fn keep_at_most(&self, n: u64) {
        let taken = self.tokens.fetch_min(n, Ordering::AcqRel).saturating_sub(n);
        self.upstream.pending_prefill.fetch_sub(taken, Ordering::Relaxed);
        if let Some((ranks, rank)) = self.rank.get() {
            ranks.sub_prefill(*rank, taken);
        }
    }
}

impl crate::index::OnStored for PendingPrefill {
    fn stored(&self) {
        self.release();
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.prefill_done();
        self.upstream.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.upstream.sequences.fetch_sub(self.sequences, Ordering::Relaxed);
        self.upstream.waiters.freed(self.upstream.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A replica going out wakes the requests waiting for room, as one coming back does:
    /// with none up, the ejected and late are eligible in its stead. Those waiting for it
    /// alone slept on until their timeout (a 503) while new requests went to the others.
    #[tokio::test]
    async fn a_replica_going_out_wakes_the_requests_waiting() {
        let waiters = Arc::new(Waiters::default());
        let (b, other) = (ReplicaId(1), ReplicaId(2));
        let upstream = Upstream::waking(waiters.clone(), b);
        let outs: [&dyn Fn(&Upstream); 4] =
            [&|u| u.set_healthy(false), &|u| u.set_draining(true), &|u| u.set_serving(false), &|u| {
                assert!(u.record_failure(1, Duration::from_secs(3600)))
            }];
        let replicas = [b, other];
        for out in outs {
            let mut ticket = waiters.ticket(0);
            {
                let wait = ticket.wait(&replicas, waiters.frees());
                tokio::pin!(wait);
                assert!(futures::poll!(wait.as_mut()).is_pending());
                out(&upstream);
                assert!(futures::poll!(wait.as_mut()).is_ready(), "woken");
            }
            drop(ticket);
            // Back, for the next.
            upstream.set_healthy(true);
            upstream.set_draining(false);
            upstream.set_serving(true);
            upstream.record_success();
            *upstream.ejected_until.lock().unwrap() = None;
            upstream.ejected.store(false, Ordering::Release);
        }
    }

    #[test]
    fn a_replica_is_unhealthy_after_failed_checks_in_a_row_and_healthy_after_one_passed() {
        let u = Upstream::default();
        assert!(u.record_check(Check::Failed, 3) && u.record_check(Check::Failed, 3), "two failed checks");
        assert!(u.record_check(Check::Passed, 3));
        assert!(
            u.record_check(Check::Failed, 3) && u.record_check(Check::Failed, 3),
            "counted from the pass"
        );
        assert!(!u.record_check(Check::Failed, 3));
        assert!(!u.is_healthy());
        assert!(u.record_check(Check::Passed, 3) && u.is_healthy());
        assert!(!u.record_check(Check::Failed, 1), "--unhealthy-after 1: one is enough");
    }

    #[test]
    fn guard_releases_load_once() {
        let u = Arc::new(Upstream::default());
        let mut g = u.begin(1, 100, 0);
        assert_eq!(u.load(), Load { in_flight: 1, pending_prefill_tokens: 100, ..Load::default() });
        g.prefilled_elsewhere(2);
        assert_eq!(u.load().pending_prefill_tokens, 2, "its prompts' last tokens are computed here");
        g.prefilled_elsewhere(1);
        assert_eq!(u.load().pending_prefill_tokens, 1);
        g.prefill_done();
        assert_eq!(u.load().pending_prefill_tokens, 0);
        g.prefilled_elsewhere(1);
        assert_eq!(u.load().pending_prefill_tokens, 0, "nothing is added back");
        drop(g);
        assert_eq!(u.load(), Load::default());
    }

    /// A request sent to a data-parallel rank holds its pending prefill on the rank too,
    /// released with the replica's (at its first data, its stored prompt, or its end).
    #[test]
    fn a_ranks_pending_prefill_goes_with_the_replicas() {
        let u = Arc::new(Upstream::default());
        let index = crate::index::SharedIndex::with_credit_ttl(Duration::from_secs(60));
        let ranks = Arc::new(crate::index::Ranks::new(2, index, kvroute_proto::ReplicaId(0)).unwrap());
        let pending = |ranks: &crate::index::Ranks| {
            ranks.views(&[]).iter().map(|v| v.pending_prefill_tokens).collect::<Vec<_>>()
        };
        let mut g = u.begin(1, 100, 300);
        g.hold_rank(ranks.begin(1, 1, (&[], 0, 0), 300));
        assert_eq!(pending(&ranks), [0, 100]);
        crate::index::OnStored::stored(&*g.pending_prefill());
        assert_eq!((u.load().pending_prefill_tokens, pending(&ranks)), (0, vec![0, 0]));
        let mut g = u.begin(1, 50, 300);
        g.hold_rank(ranks.begin(0, 1, (&[], 0, 0), 300));
        assert_eq!(pending(&ranks), [50, 0]);
        drop(g);
        assert_eq!(pending(&ranks), [0, 0], "released at the end");
    }

    /// A request of several sequences (prompts times `n`) weighs as many in the load the
    /// policies read, and as one request against the per-replica limit.
    #[test]
    fn a_request_counts_its_sequences_in_load_and_once_against_the_limit() {
        let u = Arc::new(Upstream::default());
        let many = u.begin(4, 0, 0);
        assert_eq!(u.load().in_flight, 4);
        assert_eq!(u.eligibility(2), Ok(()), "one request of the two allowed");
        let one = u.begin(1, 0, 0);
        assert_eq!(u.load().in_flight, 5);
        assert_eq!(u.eligibility(2), Err(Ineligible::Saturated));
        drop(many);
        assert_eq!((u.load().in_flight, u.eligibility(2)), (1, Ok(())));
        drop(one);
        assert_eq!(u.load(), Load::default());
    }

    /// Threads taking a replica's last room at once: one takes it, the rest find none. (A
    /// check followed by a count let two pass the check before either counted.)
    #[test]
    fn the_last_room_is_taken_once() {
        let u = Arc::new(Upstream::default());
        let over = AtomicU32::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20_000 {
                        if let Some(taken) = u.try_begin(1, 1, 0, 0) {
                            if u.requests_in_flight() > 1 {
                                over.fetch_add(1, Ordering::Relaxed);
                            }
                            drop(taken);
                        }
                    }
                });
            }
        });
        assert_eq!(over.load(Ordering::Relaxed), 0, "times a room was taken twice");
        assert_eq!(u.load(), Load::default());
        let held = u.try_begin(2, 3, 0, 0).expect("room for two");
        assert!(u.try_begin(2, 1, 0, 0).is_some_and(|_| u.try_begin(2, 1, 0, 0).is_none()), "one more");
        assert_eq!(u.load().in_flight, 3, "its sequences");
        drop(held);
    }

    #[tokio::test(start_paused = true)]
    async fn recent_prompt_tokens_outlive_the_request_and_decay() {
        let u = Arc::new(Upstream::default());
        drop(u.begin(1, 100, 1000));
        drop(u.begin(1, 0, 500));
        assert_eq!(u.load().recent_prompt_tokens, 1500);
        assert_eq!(u.load().in_flight, 0);
        tokio::time::advance(crate::policy::RECENT_HORIZON).await;
        assert_eq!(u.load().recent_prompt_tokens, (1500.0 / std::f64::consts::E).round() as u64);
    }

    /// Others' work is what a report holds beyond this router's in-flight requests when it
    /// is read, and stays that until the next report: this router's own requests that end
    /// after it never turn into others'. A check without a report clears it.
    #[tokio::test(start_paused = true)]
    async fn others_are_counted_against_the_in_flight_requests_of_the_report() {
        let u = Arc::new(Upstream::default());
        let guards: Vec<_> = (0..3).map(|_| u.begin(1, 0, 0)).collect();
        u.set_reported(Some((2, 4)), u.report_mark());
        assert_eq!(u.load().others, 3, "6 reported, 3 of them ours");
        let mark = u.report_mark();
        drop(guards);
        assert_eq!(u.load().others, 3, "ours ending after the report are not others'");
        u.set_reported(Some((0, 5)), mark);
        assert_eq!(u.load().others, 2, "3 of ours were in flight when the check began");
        u.set_reported(None, ReportMark::default());
        assert_eq!((u.load().others, u.load().reported_waiting), (0, 0));
        // Ours that began during the scrape are ours too, though others of ours ended.
        let first: Vec<_> = (0..10).map(|_| u.begin(1, 0, 0)).collect();
        let mark = u.report_mark();
        let _second: Vec<_> = (0..10).map(|_| u.begin(1, 0, 0)).collect();
        drop(first);
        u.set_reported(Some((0, 20)), mark);
        assert_eq!(u.load().others, 0, "all 20 were this router's");
    }

    /// A fleet whose checks all go unanswered in time (busy, at its peak) is not taken out
    /// whole: with no replica up, those late are tried; those whose checks were refused or
    /// failed are not, nor are the late ones while another replica is up. Every replica was
    /// out, and every request got 503.
    #[test]
    fn a_fleet_late_to_its_checks_is_still_tried() {
        let checked = |check| {
            let u = Arc::new(Upstream::default());
            assert!(!u.record_check(check, 1));
            u
        };
        let of = |us: &[&Arc<Upstream>]| verdicts(us.iter().map(|u| &***u), 8);
        let (late, down) = (checked(Check::Late), checked(Check::Failed));
        assert_eq!(of(&[&late, &down]), [None, Some(Ineligible::Unhealthy)]);
        let up = Arc::new(Upstream::default());
        assert_eq!(of(&[&late, &up]), [Some(Ineligible::Unhealthy), None], "another is up");
        // Late, then refused: down.
        assert!(!late.record_check(Check::Failed, 1));
        assert_eq!(of(&[&late, &down]), [Some(Ineligible::Unhealthy); 2]);
    }

    /// Ejection is set aside only when every replica that is up is ejected; replicas that
    /// are down, draining, not serving or saturated stay out, and keep the others' ejection
    /// in force.
    #[tokio::test(start_paused = true)]
    async fn ejection_is_set_aside_only_when_every_replica_up_is_ejected() {
        let ejected = || {
            let u = Arc::new(Upstream::default());
            assert!(u.record_failure(1, Duration::from_secs(60)));
            u
        };
        let of = |us: &[&Arc<Upstream>]| verdicts(us.iter().map(|u| &***u), 1);
        let (a, b) = (ejected(), ejected());
        assert_eq!(of(&[&a, &b]), [None, None], "all up replicas ejected: all tried");
        let down = ejected();
        down.set_healthy(false);
        let draining = Arc::new(Upstream::default());
        draining.set_draining(true);
        let unready = Arc::new(Upstream::default());
        unready.set_serving(false);
        assert_eq!(
            of(&[&a, &down, &draining, &unready]),
            [None, Some(Ineligible::Unhealthy), Some(Ineligible::Draining), Some(Ineligible::NotServing)],
            "down, draining and not serving replicas stay out"
        );
        unready.set_serving(true);
        assert_eq!(of(&[&a, &unready]), [Some(Ineligible::Ejected), None], "serving again");
        let busy = Arc::new(Upstream::default());
        let _guard = busy.begin(1, 0, 0);
        assert_eq!(
            of(&[&a, &busy]),
            [Some(Ineligible::Ejected), Some(Ineligible::Saturated)],
            "a saturated replica is up: the ejection holds"
        );
        let _also_busy = b.begin(1, 0, 0);
        assert_eq!(of(&[&a, &b]), [None, Some(Ineligible::Saturated)], "revived within its in-flight limit");
        let fine = Arc::new(Upstream::default());
        assert_eq!(of(&[&a, &fine]), [Some(Ineligible::Ejected), None]);
    }

    /// For a request to an adapter loaded through the router, a replica without it is out,
    /// and an ejected one that has it is tried rather than leave nothing.
    #[tokio::test(start_paused = true)]
    async fn a_replica_without_the_adapter_is_out_and_counts_as_down() {
        let with = Arc::new(Upstream::default());
        with.mark_adapter("sql", true);
        let without = Arc::new(Upstream::default());
        let of = |us: &[&Arc<Upstream>], adapter| verdicts_for(us.iter().map(|u| &***u), 8, adapter);
        assert_eq!(of(&[&with, &without], Some(Adapter::Loaded("sql"))), [None, Some(Ineligible::NoAdapter)]);
        assert_eq!(of(&[&with, &without], None), [None, None], "the base model: both");
        assert!(with.record_failure(1, Duration::from_secs(60)));
        assert_eq!(
            of(&[&with, &without], Some(Adapter::Loaded("sql"))),
            [None, Some(Ineligible::NoAdapter)],
            "the only replica with the adapter is ejected: tried after all"
        );
        assert_eq!(of(&[&with, &without], None), [Some(Ineligible::Ejected), None]);
        with.mark_adapter("sql", false);
        assert_eq!(of(&[&with], Some(Adapter::Loaded("sql"))), [Some(Ineligible::NoAdapter)]);
    }

    /// For a request to any other adapter, a replica is out when its last list leaves it out,
    /// and in until it has listed its adapters (it may have it).
    #[test]
    fn a_replica_whose_list_leaves_the_adapter_out_is_out() {
        let (listing, other, unlisted) =
            (Arc::new(Upstream::default()), Arc::new(Upstream::default()), Arc::new(Upstream::default()));
        listing.set_listed_adapters(Some(HashSet::from(["sql".to_owned()])));
        other.set_listed_adapters(Some(HashSet::from(["chat".to_owned()])));
        let of = |adapter| verdicts_for([&*listing, &*other, &*unlisted].into_iter(), 8, adapter);
        let lacks = Some(Ineligible::NoAdapter);
        assert_eq!(of(Some(Adapter::Listed("sql"))), [None, lacks, None]);
        assert_eq!(of(Some(Adapter::Listed("chat"))), [lacks, None, None]);
        assert_eq!(of(None), [None, None, None], "the base model: all");
        other.set_draining(true);
        assert_eq!(
            of(Some(Adapter::Listed("chat"))),
            [None, Some(Ineligible::Draining), None],
            "the one that lists it is draining: any other's to take or refuse"
        );
        other.set_draining(false);
        other.set_listed_adapters(Some(HashSet::new()));
        assert_eq!(
            of(Some(Adapter::Listed("chat"))),
            [None, None, None],
            "listed nowhere: any replica's to take or refuse (one that lists nothing is no lister)"
        );
        other.set_listed_adapters(None);
        assert_eq!(
            of(Some(Adapter::Listed("sql"))),
            [None, None, None],
            "a check read no list: it may have it"
        );
        assert_eq!(
            of(Some(Adapter::Loaded("sql"))),
            [lacks, lacks, lacks],
            "one loaded through the router goes by what the router knows it was given"
        );
    }

    /// What a replica listed is told from its having listed nothing readable.
    #[test]
    fn a_list_of_no_adapters_is_not_a_list_unread() {
        let u = Upstream::default();
        assert_eq!(u.listed_adapters(), None, "never checked");
        u.set_listed_adapters(Some(HashSet::new()));
        assert_eq!(u.listed_adapters(), Some(Vec::new()));
        u.set_listed_adapters(Some(HashSet::from(["b".to_owned(), "a".to_owned()])));
        assert_eq!(u.listed_adapters(), Some(vec!["a".to_owned(), "b".to_owned()]));
        u.set_listed_adapters(None);
        assert_eq!(u.listed_adapters(), None, "a list no longer read");
    }

    /// A replica whose list of adapters changes wakes the requests waiting for room: one
    /// gained may take its requests here, one dropped by its last lister anywhere.
    #[test]
    fn a_replica_whose_adapters_change_wakes_the_waiting_requests() {
        let waiters = Arc::new(Waiters::default());
        let u = Upstream::waking(waiters.clone(), ReplicaId(1));
        let listing = |names: &[&str]| {
            let seen = waiters.frees();
            u.set_listed_adapters(Some(names.iter().map(|name| (*name).to_owned()).collect()));
            waiters.frees() != seen
        };
        assert!(!listing(&["sql"]), "a first list only narrows what the replica may have");
        assert!(!listing(&["sql"]));
        // The adapter's last lister no longer lists it: its requests may go anywhere now.
        assert!(listing(&[]));
        assert!(listing(&["chat"]));
        let seen = waiters.frees();
        u.set_listed_adapters(None);
        assert_ne!(waiters.frees(), seen, "a list no longer read widens what it may have");
    }

    /// Saturated means a replica that could take the request once it has room: one without
    /// the adapter is out whatever its load (a request would wait in line for it in vain).
    #[test]
    fn a_saturated_replica_without_the_adapter_is_out_for_the_adapter() {
        let (with, without) = (Arc::new(Upstream::default()), Arc::new(Upstream::default()));
        with.mark_adapter("sql", true);
        let _busy = [with.begin(1, 0, 0), without.begin(1, 0, 0)];
        let of = |adapter| verdicts_for([&*with, &*without].into_iter(), 1, adapter);
        let saturated = Some(Ineligible::Saturated);
        assert_eq!(of(Some(Adapter::Loaded("sql"))), [saturated, Some(Ineligible::NoAdapter)]);
        assert_eq!(of(None), [saturated, saturated]);
    }

    /// A replica that comes back (healthy, no longer drained, serving) wakes the requests
    /// waiting for room, as one that goes out does; a setting that changes nothing wakes none.
    #[tokio::test]
    async fn a_replica_that_comes_back_wakes_the_waiting_requests() {
        let waiters = Arc::new(Waiters::default());
        let u = Arc::new(Upstream::waking(waiters.clone(), ReplicaId(3)));
        for (change, back) in [
            (&(|| u.set_healthy(false)) as &dyn Fn(), true),
            (&|| u.set_healthy(true), true),
            (&|| u.set_healthy(true), false),
            (&|| u.set_draining(true), true),
            (&|| u.set_draining(true), false),
            (&|| u.set_draining(false), true),
            (&|| u.set_serving(false), true),
            (&|| u.set_serving(true), true),
            (&|| u.set_serving(true), false),
        ] {
            let seen = waiters.frees();
            change();
            assert_eq!(waiters.frees() != seen, back);
        }
        let seen = waiters.frees();
        drop(u.begin(1, 0, 0));
        assert_ne!(waiters.frees(), seen, "a request's end frees room");
    }

    /// Requests waiting for room elsewhere are woken when an ejection ends (the replica may
    /// take them), not before.
    #[tokio::test(start_paused = true)]
    async fn an_ejections_end_wakes_the_waiting_requests() {
        let waiters = Arc::new(Waiters::default());
        let u = Upstream::waking(waiters.clone(), ReplicaId(3));
        assert!(u.record_failure(1, Duration::from_secs(10)));
        let (mut ticket, seen) = (waiters.ticket(0), waiters.frees());
        let during = tokio::time::timeout(Duration::from_secs(9), ticket.wait(&[ReplicaId(4)], seen)).await;
        assert!(during.is_err(), "woken while it is ejected");
        let after = tokio::time::timeout(Duration::from_secs(2), ticket.wait(&[ReplicaId(4)], seen)).await;
        assert!(after.is_ok(), "not woken when its ejection ended");
        assert_eq!(u.eligibility(10), Ok(()));
    }

    #[tokio::test(start_paused = true)]
    async fn ejection_after_failures_and_recovery() {
        let u = Upstream::default();
        let ejection = Duration::from_secs(10);
        assert!(!u.record_failure(3, ejection));
        assert!(!u.record_failure(3, ejection));
        assert!(u.record_failure(3, ejection));
        assert_eq!(u.eligibility(10), Err(Ineligible::Ejected));
        tokio::time::advance(Duration::from_secs(11)).await;
        assert_eq!(u.eligibility(10), Ok(()));
        // Still on probation: the next failure ejects again at once.
        assert!(u.record_failure(3, ejection));
        tokio::time::advance(Duration::from_secs(11)).await;
        u.record_success();
        assert!(!u.record_failure(3, ejection), "a success resets the count");
        // A failure just after an ejection's time is up, before any decision looked at the
        // replica, ejects it again too.
        assert!(!u.record_failure(3, ejection));
        assert!(u.record_failure(3, ejection));
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(u.record_failure(3, ejection), "ejected again");
        assert_eq!(u.eligibility(10), Err(Ineligible::Ejected));
    }

    #[test]
    fn a_usage_without_cached_tokens_is_a_miss_once_the_replica_has_said_them() {
        use super::super::body::Usage;
        let u = Upstream::default();
        let counted = Usage { cached_tokens: None, counted: true };
        let chat = "/v1/chat/completions";
        assert_eq!(u.cached_tokens(counted, chat), None, "not known to say them yet");
        assert_eq!(u.cached_tokens(Usage { cached_tokens: Some(32), counted: true }, chat), Some(32));
        assert_eq!(u.cached_tokens(counted, chat), Some(0));
        assert_eq!(u.cached_tokens(counted, "/v1/completions"), Some(0), "the same usage");
        assert_eq!(u.cached_tokens(Usage::default(), chat), None, "no usage");
        // Regression: each API says them its own way (vLLM's Responses always, its chat only
        // with a flag): one Responses answer made every chat without them a miss.
        let u = Upstream::default();
        assert_eq!(
            u.cached_tokens(Usage { cached_tokens: Some(0), counted: true }, "/v1/responses"),
            Some(0)
        );
        assert_eq!(u.cached_tokens(counted, "/v1/responses/resp_1"), Some(0));
        for other in [chat, "/v1/messages", "/generate"] {
            assert_eq!(u.cached_tokens(counted, other), None, "{other}");
        }
    }

    /// A room held for a woken request is taken for every other decision, and free for its
    /// own.
    #[tokio::test]
    async fn a_room_held_for_a_woken_request_is_its_own() {
        let waiters = Arc::new(Waiters::default());
        let u = Arc::new(Upstream::waking(waiters.clone(), ReplicaId(3)));
        let busy = u.begin(1, 0, 0);
        assert_eq!(u.eligibility(1), Err(Ineligible::Saturated));
        let mut ticket = waiters.ticket(0);
        woken_by(&waiters, &mut ticket, busy).await;
        assert_eq!(u.eligibility(1), Err(Ineligible::Saturated), "held for the woken request");
        let own = super::super::waiters::holding(ticket.hold(), async { u.eligibility(1) }).await;
        assert_eq!(own, Ok(()));
        ticket.placed(Some(ReplicaId(3)));
        assert_eq!(u.eligibility(1), Ok(()));
    }

    /// `ticket` waits for replica 3's room, and is woken as `ending`, a request there, ends.
    async fn woken_by(waiters: &Waiters, ticket: &mut super::super::waiters::Ticket<'_>, ending: LoadGuard) {
        let wait = ticket.wait(&[ReplicaId(3)], waiters.frees());
        tokio::pin!(wait);
        assert!(futures::poll!(wait.as_mut()).is_pending());
        drop(ending);
        assert!(futures::poll!(wait.as_mut()).is_ready(), "woken");
    }

    /// `ticket` woken as one of two requests on replica 3 ends; the other ends too: one room
    /// is held for it, and one is free.
    async fn woken_beside_a_free_room(
        waiters: &Waiters,
        u: &Arc<Upstream>,
        ticket: &mut super::super::waiters::Ticket<'_>,
    ) {
        let (first, second) = (u.begin(1, 0, 0), u.begin(1, 0, 0));
        woken_by(waiters, ticket, first).await;
        drop(second);
    }

    /// A woken request's decision that takes the room that woke it ends its hold as it does:
    /// the room counts once, and a request deciding before the woken one is placed finds the
    /// room left beside it. (Held until it was placed, the room counted twice meanwhile, and
    /// that request waited with nothing to wake it.)
    #[tokio::test]
    async fn a_woken_request_taking_its_room_ends_its_hold() {
        let waiters = Arc::new(Waiters::default());
        let u = Arc::new(Upstream::waking(waiters.clone(), ReplicaId(3)));
        let mut ticket = waiters.ticket(0);
        woken_beside_a_free_room(&waiters, &u, &mut ticket).await;
        assert!(u.has_room(2), "one room held, one free");
        let taken = super::super::waiters::holding(ticket.hold(), async { u.try_begin(2, 1, 0, 0) }).await;
        assert!(taken.is_some(), "the held room, its own");
        assert_eq!(ticket.holding(), None, "held no more");
        assert!(u.has_room(2), "the free room, for the next request");
        let frees = waiters.frees();
        ticket.placed(Some(ReplicaId(3)));
        assert_eq!(waiters.frees(), frees, "nothing to pass on");
        let free = u.try_begin(2, 1, 0, 0);
        assert!(free.is_some() && !u.has_room(2), "the free room taken, and no more");
    }

    /// A request that went into line in the moment a woken request's room counted twice (its
    /// count and its hold, between the two) is woken as the hold ends with room left. (Nothing
    /// woke it: it waited until a request there ended, or its time was up.)
    #[tokio::test]
    async fn a_hold_ending_with_room_left_wakes_the_line() {
        let waiters = Arc::new(Waiters::default());
        let u = Arc::new(Upstream::waking(waiters.clone(), ReplicaId(3)));
        let mut ticket = waiters.ticket(0);
        woken_beside_a_free_room(&waiters, &u, &mut ticket).await;
        let mut late = waiters.ticket(0);
        let wait = late.wait(&[ReplicaId(3)], waiters.frees());
        tokio::pin!(wait);
        assert!(futures::poll!(wait.as_mut()).is_pending(), "in line");
        let taken = super::super::waiters::holding(ticket.hold(), async { u.try_begin(2, 1, 0, 0) }).await;
        assert!(taken.is_some());
        assert!(futures::poll!(wait.as_mut()).is_ready(), "woken: a room is left");
    }

    #[test]
    fn saturation_draining_and_health() {
        let u = Arc::new(Upstream::default());
        let _g = u.begin(1, 0, 0);
        assert_eq!(u.eligibility(1), Err(Ineligible::Saturated));
        assert_eq!(u.eligibility(2), Ok(()));
        u.set_healthy(false);
        assert_eq!(u.eligibility(2), Err(Ineligible::Unhealthy));
        u.set_draining(true);
        assert_eq!(u.eligibility(2), Err(Ineligible::Draining));
    }
}
