//! The proxy's Prometheus metrics, all prefixed `kvroute_router_`: decisions per policy,
//! predicted and realized cached tokens (realized = `usage.prompt_tokens_details.cached_tokens`
//! read from the responses; Responses' `input_tokens_details`, Anthropic's
//! `cache_read_input_tokens`; a usage without them, from a replica that has said them before,
//! is a miss: vLLM leaves them out when there are none), requests by status code, retries, ejections, and latency
//! histograms of the decision path and of the upstream time to first byte; the tokenizer's
//! prefix cache; and each replica's load and state as the proxy sees them
//! ([`register_replica_load`]).

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use kvroute_proto::openai::Tokenization;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::fleet::{Fleet, Member};
use crate::policy::{Load, PolicyKind};
use crate::proxy::connect::ReplicaTls;
use crate::proxy::key_file::KeyFile;
use crate::proxy::live::{Live, Routing};
use crate::proxy::replica_key::ReplicaKeyFile;
use kvroute_proto::serve::Tls;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabel {
    pub policy: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabel {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabel {
    pub outcome: &'static str,
}

/// Buckets of `upstream_ttfb_seconds`: 1 ms doubling to 1049 s, past the default first-byte
/// timeout (600 s; a non-streamed answer's first byte comes when it is all generated).
const TTFB_BUCKETS: u16 = 21;

/// The counters of the routed requests whose answers reported their cached tokens: the
/// realized hit rate, and the predicted one of the same requests beside it.
#[derive(Debug, Default)]
pub struct Reported {
    /// Prompt tokens the replicas reported as cached.
    pub realized_cached_tokens: Counter,
    /// Those requests' prompt tokens (the realized hit rate's denominator).
    pub prompt_tokens: Counter,
    /// The cached tokens predicted of them.
    pub predicted_cached_tokens: Counter,
}

/// Handles to every proxy metric; cheap to clone.
#[derive(Clone, Debug)]
pub struct ProxyMetrics {
    /// Counted through [`Self::count_decision`] (its cache holds this family's counters).
    decisions: Family<PolicyLabel, Counter>,
    pub predicted_cached_tokens: Counter,
    /// Prompt tokens of routed requests (the denominator of the predicted hit rate).
    pub prompt_tokens: Counter,
    /// What the answers that report their cached tokens count (one handle a response).
    pub reported: Arc<Reported>,
    /// Routed requests whose tokens were known only in part (chats with media).
    pub partial_prompts: Counter,
    /// Counted through [`Self::count_response`].
    requests: Family<CodeLabel, Counter>,
    pub errors: Family<ErrorLabel, Counter>,
    pub retries: Counter,
    /// Looking up the replica that stored a Responses API response, by outcome.
    pub response_lookups: Family<OutcomeLabel, Counter>,
    /// Requests of a fleet with prefill replicas, by what came of their prefill
    /// ([`crate::proxy::disagg`]).
    pub prefills: Family<OutcomeLabel, Counter>,
    pub ejections: Counter,
    /// HTTP/2 responses cut because their client stopped taking data (HTTP/1 connections
    /// closed so are counted in `kvroute_router_client_send_timeouts`).
    pub client_stalls: Counter,
    pub in_flight: Gauge,
    /// Requests waiting for room ([`crate::proxy::queue`]).
    pub queued: Gauge,
    /// How long requests waited in line, whatever came of it.
    pub queue_wait_seconds: Histogram,
    /// What came of requests' waits, by outcome.
    pub queue_outcomes: Family<OutcomeLabel, Counter>,
    /// Background Responses API responses whose places are held ([`crate::proxy::background`]).
    pub background_responses: Gauge,
    /// Those let go, by why.
    pub background_released: Family<OutcomeLabel, Counter>,
    pub decision_seconds: Histogram,
    pub upstream_ttfb_seconds: Histogram,
    pub upstream_duration_seconds: Histogram,
    /// The usual labels' counters, kept at hand once first used ([`Self::count_decision`],
    /// [`Self::count_response`]): a family's lookup takes a lock and hashes the label, which
    /// showed in the proxy's profiles.
    usual: Arc<UsualCounters>,
}

#[derive(Debug, Default)]
struct UsualCounters {
    /// `decisions` of each policy, by [`PolicyKind`] (a reload may switch policies).
    decisions: [OnceLock<Counter>; PolicyKind::ALL.len()],
    /// `requests{code="200"}`.
    ok: OnceLock<Counter>,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self {
            decisions: Family::default(),
            predicted_cached_tokens: Counter::default(),
            prompt_tokens: Counter::default(),
            reported: Arc::default(),
            partial_prompts: Counter::default(),
            requests: Family::default(),
            errors: Family::default(),
            retries: Counter::default(),
            response_lookups: Family::default(),
            prefills: Family::default(),
            ejections: Counter::default(),
            client_stalls: Counter::default(),
            in_flight: Gauge::default(),
            queued: Gauge::default(),
            // 1 ms .. ~70 min, past the longest `--queue-timeout-ms`.
            queue_wait_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 23)),
            queue_outcomes: Family::default(),
            background_responses: Gauge::default(),
            background_released: Family::default(),
            // 1 µs .. ~67 s: with remote tokenization a decision includes `/tokenize` calls
            // (10 s at most by default, at each of up to three replicas).
            decision_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 27)),
            // 1 ms .. ~1049 s
            upstream_ttfb_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, TTFB_BUCKETS)),
            // As long, and one more doubling: a stream goes on after its first byte.
            upstream_duration_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, TTFB_BUCKETS + 1)),
            usual: Arc::default(),
        }
    }
}

impl ProxyMetrics {
    /// Creates the metrics and registers them in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("kvroute_router");
        r.register("decisions", "Routing decisions, by policy", m.decisions.clone());
        r.register(
            "predicted_cached_tokens",
            "Prompt tokens the router predicted the chosen replica had cached",
            m.predicted_cached_tokens.clone(),
        );
        r.register(
            "realized_cached_tokens",
            "Prompt tokens the replicas reported as cached (usage.prompt_tokens_details, or its Responses and Messages spellings)",
            m.reported.realized_cached_tokens.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of routed requests (not of a batch of prompts or of choices, nor of a chat \
             with media: the hit rates' denominator)",
            m.prompt_tokens.clone(),
        );
        r.register(
            "reported_prompt_tokens",
            "Prompt tokens of routed requests whose answer reported its cached tokens \
             (realized_cached_tokens over this is the realized hit rate)",
            m.reported.prompt_tokens.clone(),
        );
        r.register(
            "reported_predicted_cached_tokens",
            "Predicted cached tokens of routed requests whose answer reported its cached tokens \
             (to set beside realized_cached_tokens)",
            m.reported.predicted_cached_tokens.clone(),
        );
        r.register(
            "partial_prompts",
            "Routed requests whose tokens were known only up to their first media (an image, audio), \
             and whose media's tokens are in neither token count",
            m.partial_prompts.clone(),
        );
        r.register(
            "requests",
            "Requests by the status of their answer (499: the client left first); the router's own \
             /health, /ready and /metrics not counted",
            m.requests.clone(),
        );
        r.register("errors", "Errors the router answered itself, by kind", m.errors.clone());
        r.register(
            "retries",
            "Attempts on another replica after a request's first failed",
            m.retries.clone(),
        );
        r.register(
            "response_lookups",
            "Requests about a stored Responses API response, by how its replica was found: known (remembered), found (by asking every replica), missing (no replica has it: 404), known_missing (404 without asking: again within 2 s, or an empty id), refused (every replica refused alike, a wrong API key say: their status), unanswered (a replica that may have it did not answer: 503), owner_gone (the replica that stored it is out of the fleet, and no other has it: 503); waited counts lookups that waited for another of the same id to finish, then read its answer",
            m.response_lookups.clone(),
        );
        r.register(
            "prefills",
            "Requests a fleet with prefill and decode replicas routed, by where their prompt was prefilled: remote (on a prefill replica, then decoded elsewhere), bootstrap (on an SGLang prefill replica, decoded at once through a bootstrap room), cached (the decode replica lacked fewer than --pd-min-prefill-tokens), not_split (several choices, media, or another API: decoded whole), no_replica (no prefill replica had room), failed (the prefill replica failed or answered 5xx), no_params (it answered without kv_transfer_params: no connector?); all but remote and bootstrap were prefilled where they were decoded (an SGLang decode replica cannot: its failed and no_replica ended the request), refused (a 4xx from the prefill replica) went to no decode replica",
            m.prefills.clone(),
        );
        r.register("ejections", "Replicas ejected as outliers", m.ejections.clone());
        r.register(
            "client_stalls",
            "HTTP/2 responses cut because their stream had no window for the send timeout",
            m.client_stalls.clone(),
        );
        r.register_collector(Box::new(SendTimeouts));
        r.register("in_flight", "Requests in flight through the router", m.in_flight.clone());
        r.register(
            "queued",
            "Requests waiting for room (the router at --max-in-flight, or every replica they could go to at --max-in-flight-per-replica)",
            m.queued.clone(),
        );
        r.register(
            "queue_wait_seconds",
            "Time requests waited for room, whatever came of it",
            m.queue_wait_seconds.clone(),
        );
        r.register(
            "queue_outcomes",
            "Requests that waited for room or found the line full, by outcome: placed (got room), refused (another error ended the wait: no healthy replica left, say), timed_out (503 after --queue-timeout-ms), full (503 at once: --max-queued waiting already), left (the client left while it waited)",
            m.queue_outcomes.clone(),
        );
        r.register(
            "background_responses",
            "Responses API responses generated in the background (background: true) whose request's places (in flight, its key's, its load on its replica) the router holds until the replica shows them final",
            m.background_responses.clone(),
        );
        r.register(
            "background_released",
            "Background responses whose places were let go, by why: final (completed, incomplete, failed or cancelled), missing (the replica no longer has it: 404), gone (the replica left the fleet), unanswered (5 asks in a row without a readable answer: none in time, or another status than 200 or 404), expired (held an hour), shutdown; unlearned counts answers cut off before they showed the response's id: nothing held",
            m.background_released.clone(),
        );
        r.register(
            "decision_seconds",
            "Time to decide where a request goes (parse, tokenize, hash, lookup, score), whether or not a replica could be chosen",
            m.decision_seconds.clone(),
        );
        r.register(
            "upstream_ttfb_seconds",
            "Time from sending a request to a replica to the first data of its response, past a Responses stream's opening events (a streamed upload's time included; of a request whose prefill went ahead, its decode's)",
            m.upstream_ttfb_seconds.clone(),
        );
        r.register(
            "upstream_duration_seconds",
            "Time from sending a request to a replica to the end of its response, however it ended (whole, broken off, or the client gone): a request's latency in all, but for its decision and any wait for room (of a request whose prefill went ahead, its decode's)",
            m.upstream_duration_seconds.clone(),
        );
        m
    }

    /// Counts a decision of the policy `kind`.
    pub fn count_decision(&self, kind: PolicyKind) {
        let policy = kind.as_str();
        let counter = &self.usual.decisions[kind as usize];
        counter.get_or_init(|| self.decisions.get_or_create(&PolicyLabel { policy }).clone()).inc();
    }

    /// Counts a response sent with status `code`.
    pub fn count_response(&self, code: u16) {
        if code == 200 {
            self.usual.ok.get_or_init(|| self.requests.get_or_create(&CodeLabel { code }).clone()).inc();
        } else {
            self.requests.get_or_create(&CodeLabel { code }).inc();
        }
    }
}

/// `client_send_timeouts`: client connections closed because a write to the client waited
/// for the send timeout ([`kvroute_proto::serve::send_timeout`]; counted for the process).
#[derive(Debug)]
struct SendTimeouts;

impl Collector for SendTimeouts {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counter = ConstCounter::new(kvroute_proto::serve::send_timeout::send_timeouts());
        let help = "Client connections closed because a write to the client waited for the send timeout";
        counter.encode(encoder.encode_descriptor(
            "client_send_timeouts",
            help,
            None,
            counter.metric_type(),
        )?)
    }
}

/// Registers what the files the router watches hold, read at scrape time: the served TLS
/// certificate's expiry (`kvroute_router_tls_certificate_expiry_timestamp_seconds`, for an
/// alert well before it) and that of the client certificate shown to replicas
/// (`kvroute_router_replica_tls_client_certificate_expiry_timestamp_seconds`), and the loads
/// of the TLS files, of `--api-key-file`, of `--replica-api-key-file` and of the replicas' TLS
/// files, done and refused (`kvroute_router_tls_loads_total`,
/// `kvroute_router_api_key_file_loads_total`, `kvroute_router_replica_api_key_file_loads_total`,
/// `kvroute_router_replica_tls_loads_total`): a renewed certificate or rotated key file that
/// cannot be loaded leaves the old one in use, and says so only in the log otherwise. Each
/// only while there is such a file.
pub fn register_watched_files(registry: &mut Registry, files: WatchedFiles) {
    registry.sub_registry_with_prefix("kvroute_router").register_collector(Box::new(files));
}

/// The files the router watches.
#[derive(Debug)]
pub struct WatchedFiles {
    pub tls: Option<Tls>,
    pub key_file: Arc<KeyFile>,
    pub replica_tls: ReplicaTls,
    pub replica_key_file: ReplicaKeyFile,
}

impl Collector for WatchedFiles {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let expiries = [
            (
                "tls_certificate_expiry_timestamp_seconds",
                "When the TLS certificate served now expires (its notAfter), Unix seconds",
                self.tls.as_ref().and_then(Tls::not_after),
            ),
            (
                "replica_tls_client_certificate_expiry_timestamp_seconds",
                "When the client certificate shown to https:// replicas now expires (its notAfter), Unix seconds",
                self.replica_tls.not_after(),
            ),
        ];
        for (name, help, not_after) in expiries {
            let Some(not_after) = not_after else { continue };
            let gauge = ConstGauge::new(not_after);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let loads = [
            (
                "tls_loads",
                "Loads of the TLS certificate, key and client CA files, at a reload or of a change on disk",
                self.tls.as_ref().map(Tls::loads),
            ),
            (
                "api_key_file_loads",
                "Loads of --api-key-file, at a reload or of a change on disk",
                self.key_file.loads(),
            ),
            (
                "replica_api_key_file_loads",
                "Loads of --replica-api-key-file, at a reload or of a change on disk",
                self.replica_key_file.loads(),
            ),
            (
                "replica_tls_loads",
                "Loads of --replica-ca-cert, --replica-client-cert and --replica-client-key, at a reload or of a change on disk",
                self.replica_tls.loads(),
            ),
        ];
        for (name, help, loads) in loads {
            let Some((done, refused)) = loads else { continue };
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (outcome, n) in [("loaded", done), ("refused", refused)] {
                ConstCounter::new(n).encode(family.encode_family(&OutcomeLabel { outcome })?)?;
            }
        }
        Ok(())
    }
}

/// Registers the tokenizer's prefix cache counters (`kvroute_router_tokenize_*`), read at
/// scrape time; nothing is reported while the cache is off.
pub fn register_tokenize_cache(registry: &mut Registry, tokenization: Arc<Tokenization>) {
    registry
        .sub_registry_with_prefix("kvroute_router")
        .register_collector(Box::new(TokenizeCache(tokenization)));
}

#[derive(Debug)]
struct TokenizeCache(Arc<Tokenization>);

impl Collector for TokenizeCache {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stats) = self.0.prefix_cache_stats() else { return Ok(()) };
        for (name, help, value) in [
            (
                "tokenize_reused_bytes",
                "Prompt text bytes whose token ids came from the prefix cache",
                stats.reused_bytes,
            ),
            ("tokenize_tokenized_bytes", "Prompt text bytes tokenized", stats.tokenized_bytes),
        ] {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }
        for (name, help, value) in [
            ("tokenize_cache_entries", "Entries in the tokenizer's prefix cache", stats.entries),
            ("tokenize_cache_bytes", "Weight of the tokenizer's prefix cache, bytes", stats.weight_bytes),
        ] {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

/// Registers each replica's load and state as the proxy sees them, read at scrape time, all
/// labelled `replica` (its name): requests sent to it, requests in flight, uncached prompt
/// tokens not known to be prefilled (until the first byte, or for a whole answer the
/// replica's store of the prompt's last block), the queue it last reported, its ejections, and its
/// routing state (`eligible`, or why not: `unhealthy`, `ejected`, `draining`, `not_serving`,
/// `saturated` at `--max-in-flight-per-replica` requests, as the routing is now). A removed replica's series end with it.
pub fn register_replica_load(registry: &mut Registry, fleet: Fleet, routing: Live<Routing>) {
    registry
        .sub_registry_with_prefix("kvroute_router")
        .register_collector(Box::new(ReplicaLoad { fleet, routing }));
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabel {
    replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaStateLabels {
    replica: String,
    state: &'static str,
}

/// A per-replica series: its name, its help and how to read it.
type Series<T> = (&'static str, &'static str, fn(&T) -> u64);

struct ReplicaLoad {
    fleet: Fleet,
    routing: Live<Routing>,
}

impl std::fmt::Debug for ReplicaLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaLoad").field("routing", &self.routing).finish_non_exhaustive()
    }
}

impl Collector for ReplicaLoad {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let members = self.fleet.members();
        let label = |m: &Member| ReplicaLabel { replica: m.replica.spec.name.clone() };
        let counters: [Series<Member>; 2] = [
            ("replica_requests", "Requests sent to the replica, retries included", |m| {
                m.upstream.requests.load(Ordering::Relaxed)
            }),
            ("replica_ejections", "Times the replica was ejected as an outlier", |m| {
                m.upstream.ejections.load(Ordering::Relaxed)
            }),
        ];
        for (name, help, value) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for m in &members {
                ConstCounter::new(value(m)).encode(family.encode_family(&label(m))?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "replica_in_flight",
            "Requests the router has in flight at the replica",
            None,
            MetricType::Gauge,
        )?;
        for m in &members {
            ConstGauge::new(i64::from(m.upstream.requests_in_flight()))
                .encode(family.encode_family(&label(m))?)?;
        }
        let gauges: [Series<Load>; 3] = [
            (
                "replica_in_flight_sequences",
                "Their sequences, as the replica runs them (a request's prompts times its n)",
                |l| u64::from(l.in_flight),
            ),
            (
                "replica_pending_prefill_tokens",
                "Uncached prompt tokens sent to the replica not known to be prefilled yet (no first byte, or no stored last block)",
                |l| l.pending_prefill_tokens,
            ),
            (
                "replica_reported_waiting",
                "Requests waiting in the replica's queue, as it last reported",
                |l| u64::from(l.reported_waiting),
            ),
        ];
        let loads: Vec<Load> = members.iter().map(|m| m.upstream.load()).collect();
        for (name, help, value) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (m, load) in members.iter().zip(&loads) {
                let gauge = ConstGauge::new(i64::try_from(value(load)).unwrap_or(i64::MAX));
                gauge.encode(family.encode_family(&label(m))?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "replica_state",
            "1 for the replica's routing state: eligible, or why it is not",
            None,
            MetricType::Gauge,
        )?;
        // As a decision judges them: with no replica up, the ejected, and those whose health
        // checks only went unanswered in time, are routed to, and eligible.
        let max_in_flight = self.routing.get().max_in_flight_per_replica;
        let verdicts = crate::proxy::upstream::verdicts(members.iter().map(|m| &*m.upstream), max_in_flight);
        for (m, verdict) in members.iter().zip(verdicts) {
            let state = verdict.map_or("eligible", |why| why.as_str());
            let labels = ReplicaStateLabels { replica: m.replica.spec.name.clone(), state };
            ConstGauge::new(1).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::registry::Registry;

    use super::ProxyMetrics;
    use crate::policy::PolicyKind;

    #[test]
    fn usual_and_other_labels_are_counted_in_their_own_series() {
        let mut registry = Registry::default();
        let metrics = ProxyMetrics::register(&mut registry);
        let clone = metrics.clone();
        for _ in 0..3 {
            metrics.count_decision(PolicyKind::CacheAware);
            clone.count_response(200);
        }
        clone.count_decision(PolicyKind::CacheAware);
        metrics.count_decision(PolicyKind::Random);
        metrics.count_response(404);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "kvroute_router_decisions_total{policy=\"cache-aware\"} 4",
            "kvroute_router_decisions_total{policy=\"random\"} 1",
            "kvroute_router_requests_total{code=\"200\"} 3",
            "kvroute_router_requests_total{code=\"404\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing from\n{text}");
        }
    }

    /// The largest finite bucket of the histogram `name` (not `+Inf`, which every one has).
    fn largest_bucket(name: &str, observe: impl Fn(&ProxyMetrics)) -> f64 {
        let mut registry = Registry::default();
        let metrics = ProxyMetrics::register(&mut registry);
        observe(&metrics);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let prefix = format!("kvroute_router_{name}_bucket{{le=\"");
        text.lines()
            .filter_map(|l| l.strip_prefix(prefix.as_str()))
            .filter_map(|l| l.split('"').next()?.parse::<f64>().ok())
            .filter(|le| le.is_finite())
            .fold(0.0, f64::max)
    }

    /// Time to first byte is bucketed up to the default first-byte timeout and beyond: the
    /// answers it cuts are told apart from those it lets through.
    #[test]
    fn time_to_first_byte_buckets_reach_the_first_byte_timeout() {
        let largest = largest_bucket("upstream_ttfb_seconds", |m| m.upstream_ttfb_seconds.observe(0.5));
        let timeout = crate::config::Config::loopback(Vec::new()).first_byte_timeout_ms as f64 / 1e3;
        assert!(largest >= timeout, "largest bucket {largest} s, first-byte timeout {timeout} s");
    }

    /// With remote tokenization a decision waits for `/tokenize`, up to its timeout at each
    /// replica it tries.
    #[test]
    fn decision_buckets_reach_the_tokenize_timeout() {
        let largest = largest_bucket("decision_seconds", |m| m.decision_seconds.observe(0.5));
        let timeout = crate::config::Config::loopback(Vec::new()).tokenize_timeout_ms as f64 / 1e3;
        let tries = crate::proxy::prompts::TOKENIZE_ATTEMPTS as f64;
        assert!(largest >= tries * timeout, "largest bucket {largest} s, {tries} tries of {timeout} s");
    }
}
