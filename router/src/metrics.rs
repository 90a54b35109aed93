//! The proxy's Prometheus metrics, all prefixed `kvroute_router_`: decisions per policy,
//! predicted and realized cached tokens (realized = `usage.prompt_tokens_details.cached_tokens`
//! read from the responses), requests by status code, retries, ejections, and latency
//! histograms of the decision path and of the upstream time to first byte; and the
//! tokenizer's prefix cache.

use std::sync::Arc;

use kvroute_proto::openai::Tokenization;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

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

/// Handles to every proxy metric; cheap to clone.
#[derive(Clone, Debug)]
pub struct ProxyMetrics {
    pub decisions: Family<PolicyLabel, Counter>,
    pub predicted_cached_tokens: Counter,
    pub realized_cached_tokens: Counter,
    /// Prompt tokens of routed requests (the denominator of both hit rates).
    pub prompt_tokens: Counter,
    pub requests: Family<CodeLabel, Counter>,
    pub errors: Family<ErrorLabel, Counter>,
    pub retries: Counter,
    pub ejections: Counter,
    /// Responses cut because their client stopped taking data.
    pub client_stalls: Counter,
    pub in_flight: Gauge,
    pub decision_seconds: Histogram,
    pub upstream_ttfb_seconds: Histogram,
}

impl Default for ProxyMetrics {
    fn default() -> Self {
        Self {
            decisions: Family::default(),
            predicted_cached_tokens: Counter::default(),
            realized_cached_tokens: Counter::default(),
            prompt_tokens: Counter::default(),
            requests: Family::default(),
            errors: Family::default(),
            retries: Counter::default(),
            ejections: Counter::default(),
            client_stalls: Counter::default(),
            in_flight: Gauge::default(),
            // 1 µs .. ~16 ms
            decision_seconds: Histogram::new(exponential_buckets(1e-6, 2.0, 15)),
            // 1 ms .. ~65 s
            upstream_ttfb_seconds: Histogram::new(exponential_buckets(1e-3, 2.0, 17)),
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
            "Prompt tokens the replicas reported as cached (usage.prompt_tokens_details)",
            m.realized_cached_tokens.clone(),
        );
        r.register("prompt_tokens", "Prompt tokens of routed requests", m.prompt_tokens.clone());
        r.register("requests", "Responses sent, by HTTP status", m.requests.clone());
        r.register("errors", "Errors the router answered itself, by kind", m.errors.clone());
        r.register("retries", "Requests retried on another replica", m.retries.clone());
        r.register("ejections", "Replicas ejected as outliers", m.ejections.clone());
        r.register(
            "client_stalls",
            "Responses cut because the client took nothing of them for the idle timeout",
            m.client_stalls.clone(),
        );
        r.register("in_flight", "Requests in flight through the router", m.in_flight.clone());
        r.register(
            "decision_seconds",
            "Time to choose a replica: parse, tokenize, hash, lookup, score",
            m.decision_seconds.clone(),
        );
        r.register(
            "upstream_ttfb_seconds",
            "Time from sending a request to a replica to its response headers",
            m.upstream_ttfb_seconds.clone(),
        );
        m
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
