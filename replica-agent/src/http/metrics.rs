//! `GET /metrics`: the engine's counters in Prometheus text format (0.0.4), under the names
//! vLLM uses, so dashboards and the router's scrapers work unchanged against a simulated
//! replica; kvroute's own extras are prefixed `kvroute_agent_`.
//!
//! Every sample has vLLM's `model_name` and `engine` labels: one sample a data-parallel rank
//! (`engine="0"` alone for a replica of one). Counters end in `_total` (the `# TYPE` line
//! names the sample, as Python's `prometheus_client` writes it). Values are read from the
//! engine's atomics at scrape time, so the text is a cheap, lock-free read.
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `vllm:num_requests_running` | gauge | sequences in the running batch |
//! | `vllm:num_requests_waiting` | gauge | requests waiting for admission |
//! | `vllm:kv_cache_usage_perc` | gauge | blocks running requests hold / capacity, 0..1: as vLLM's, which counts cached blocks no request holds as free (evictable) |
//! | `vllm:prefix_cache_queries_total` | counter | prompt tokens looked up in the prefix cache |
//! | `vllm:prefix_cache_hits_total` | counter | of those, tokens served from the cache |
//! | `vllm:external_prefix_cache_hits_total` | counter | prompt tokens loaded from host memory (`--offload-blocks`) or pulled after a remote prefill (`--kv-transfer-config`) |
//! | `vllm:prompt_tokens_total` | counter | prompt tokens of admitted requests |
//! | `vllm:generation_tokens_total` | counter | generated tokens |
//! | `vllm:request_success_total` | counter | finished requests (`finished_reason="length"`) |
//! | `vllm:cache_config_info` | gauge | 1, labelled as vLLM's with the KV cache's `block_size`, `num_gpu_blocks` (every rank's together, written once a rank, as vLLM writes them) and `enable_prefix_caching` (`True`): what a router sizes a replica's cache by |
//! | `kvroute_agent_requests_failed_total` | counter | requests the engine failed |
//! | `kvroute_agent_events_published_total` | counter | KV event batches published |
//! | `kvroute_agent_zmtp_refused_total` | counter | event and replay connections cut for going over the ZMTP guard's limits |
//! | `kvroute_agent_steps_total` | counter | scheduler steps run |
//! | `kvroute_agent_pending_prefill_tokens` | gauge | prompt tokens still to prefill: the uncached ones of running requests, the whole prompts of waiting ones (not looked up yet) |
//! | `kvroute_agent_resident_blocks` | gauge | blocks in the prefix cache |
//! | `kvroute_agent_capacity_blocks` | gauge | prefix-cache capacity in blocks |
//! | `kvroute_agent_offloaded_blocks` | gauge | blocks held in host memory (`--offload-blocks`) |
//! | `kvroute_agent_offload_capacity_blocks` | gauge | host memory's capacity in blocks (0: none) |
//! | `kvroute_agent_cache_policy` | gauge | 1, labelled with the eviction `policy` (`lru`, `lfu`, `s3fifo`) and, for S3FIFO, its `small_ratio` and `max_freq` |
//! | `process_start_time_seconds` | gauge | when the server started, Unix seconds (no labels, as Prometheus' Python client exports it for vLLM's process): a router predicting the cache of a replica whose events it does not follow tells a restart by it |

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use hyper::header::{self, HeaderValue};
use hyper::{Response, StatusCode};

use super::{AppState, Body, full};
use crate::cache::PolicyKind;
use crate::engine::EngineMetrics;

/// Prometheus' text exposition content type.
const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Renders the metrics page.
pub(super) fn render(state: &AppState) -> Response<Body> {
    let engines = state.ranks().all();
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    // Each metric's value in every engine, rank 0 first.
    let each = |value: &dyn Fn(&EngineMetrics) -> u64| -> Vec<u64> {
        engines.iter().map(|engine| value(engine.metrics())).collect()
    };
    let capacity = engines.first().map_or(0, |engine| engine.config().cache.capacity_blocks as u64);
    let host_capacity = engines.first().map_or(0, |engine| engine.config().offload_blocks as u64);
    let usage: Vec<f64> = each(&|m| load(&m.used_blocks))
        .into_iter()
        .map(|used| if capacity == 0 { 0.0 } else { used as f64 / capacity as f64 })
        .collect();

    let mut out = Exposition::new(&state.config().model);
    out.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        each(&|m| load(&m.running)),
    );
    out.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        each(&|m| load(&m.waiting)),
    );
    out.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage);
    out.counter(
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        each(&|m| load(&m.prefix_cache_queries)),
    );
    out.counter(
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        each(&|m| load(&m.prefix_cache_hits)),
    );
    out.counter(
        "vllm:external_prefix_cache_hits_total",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached tokens.",
        each(&|m| load(&m.external_prefix_cache_hits)),
    );
    out.counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        each(&|m| load(&m.prompt_tokens)),
    );
    out.counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        each(&|m| load(&m.generation_tokens)),
    );
    out.family("vllm:request_success_total", "counter", "Count of successfully processed requests.");
    for (rank, served) in each(&|m| load(&m.requests_served)).into_iter().enumerate() {
        out.sample("vllm:request_success_total", rank, &[("finished_reason", "length")], served);
    }
    out.counter(
        "kvroute_agent_requests_failed_total",
        "Requests the engine failed.",
        each(&|m| load(&m.requests_failed)),
    );
    out.counter(
        "kvroute_agent_events_published_total",
        "KV event batches published.",
        each(&|m| load(&m.events_published)),
    );
    out.counter(
        "kvroute_agent_zmtp_refused_total",
        "Event and replay connections cut for going over the ZMTP guard's limits.",
        each(&|m| load(&m.zmtp_refused)),
    );
    out.counter("kvroute_agent_steps_total", "Scheduler steps run.", each(&|m| load(&m.steps)));
    out.gauge(
        "kvroute_agent_pending_prefill_tokens",
        "Prompt tokens still to prefill: running requests' uncached ones, waiting requests' whole prompts.",
        each(&|m| load(&m.pending_prefill_tokens)),
    );
    out.gauge(
        "kvroute_agent_resident_blocks",
        "Blocks resident in the prefix cache.",
        each(&|m| load(&m.resident_blocks)),
    );
    out.gauge(
        "kvroute_agent_capacity_blocks",
        "Prefix-cache capacity in blocks.",
        vec![capacity; engines.len()],
    );
    out.gauge(
        "kvroute_agent_offloaded_blocks",
        "Blocks held in host memory, offloaded from the prefix cache.",
        each(&|m| load(&m.offloaded_blocks)),
    );
    out.gauge(
        "kvroute_agent_offload_capacity_blocks",
        "Host memory's capacity in blocks (0: none).",
        vec![host_capacity; engines.len()],
    );
    out.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig");
    let (block_size, all_blocks) = (
        engines.first().map_or(0, |engine| engine.config().cache.block_size).to_string(),
        (capacity * engines.len() as u64).to_string(),
    );
    for rank in 0..engines.len() {
        let labels = [
            ("block_size", block_size.as_str()),
            ("cache_dtype", "auto"),
            ("enable_prefix_caching", "True"),
            ("num_gpu_blocks", all_blocks.as_str()),
        ];
        out.sample("vllm:cache_config_info", rank, &labels, 1);
    }
    out.family(
        "kvroute_agent_cache_policy",
        "gauge",
        "Eviction policy of the prefix cache (labels), always 1.",
    );
    for (rank, engine) in engines.iter().enumerate() {
        let cache = &engine.config().cache;
        let policy = clap::ValueEnum::to_possible_value(&cache.policy).map(|v| v.get_name().to_owned());
        let (small_ratio, max_freq) =
            (cache.s3fifo.small_ratio.to_string(), cache.s3fifo.max_freq.to_string());
        let mut labels = vec![("policy", policy.as_deref().unwrap_or_default())];
        if cache.policy == PolicyKind::S3fifo {
            labels.extend([("small_ratio", small_ratio.as_str()), ("max_freq", max_freq.as_str())]);
        }
        out.sample("kvroute_agent_cache_policy", rank, &labels, 1);
    }
    out.family(
        "process_start_time_seconds",
        "gauge",
        "Start time of the process since unix epoch in seconds.",
    );
    let _ = writeln!(out.text, "process_start_time_seconds {}", state.start_time());

    let mut response = Response::new(full(out.text));
    *response.status_mut() = StatusCode::OK;
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(CONTENT_TYPE));
    response
}

/// A Prometheus text page being written; every sample gets the `model_name` label and its
/// engine's (`engine`, the data-parallel rank), as vLLM labels them.
struct Exposition {
    text: String,
    model_label: String,
}

impl Exposition {
    fn new(model: &str) -> Self {
        Exposition { text: String::with_capacity(4096), model_label: escape(model) }
    }

    fn family(&mut self, name: &str, kind: &str, help: &str) {
        // Writing to a String cannot fail.
        let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, engine: usize, labels: &[(&str, &str)], value: impl std::fmt::Display) {
        let _ = write!(self.text, "{name}{{model_name=\"{}\",engine=\"{engine}\"", self.model_label);
        for (k, v) in labels {
            let _ = write!(self.text, ",{k}=\"{}\"", escape(v));
        }
        let _ = writeln!(self.text, "}} {value}");
    }

    /// A gauge's family and a sample of each engine's value, rank 0 first.
    fn gauge<T: std::fmt::Display>(&mut self, name: &str, help: &str, values: Vec<T>) {
        self.family(name, "gauge", help);
        for (engine, value) in values.into_iter().enumerate() {
            self.sample(name, engine, &[], value);
        }
    }

    fn counter(&mut self, name: &str, help: &str, values: Vec<u64>) {
        debug_assert!(name.ends_with("_total"));
        self.family(name, "counter", help);
        for (engine, value) in values.into_iter().enumerate() {
            self.sample(name, engine, &[], value);
        }
    }
}

/// A label value escaped as the text format requires.
fn escape(value: &str) -> String {
    value.replace('\\', r"\\").replace('"', r#"\""#).replace('\n', r"\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_carry_the_escaped_model_label() {
        let mut out = Exposition::new("a\"b");
        out.counter("x_total", "help", vec![3, 4]);
        out.sample("y", 0, &[("k", "v")], 1.5);
        assert_eq!(
            out.text,
            "# HELP x_total help\n# TYPE x_total counter\nx_total{model_name=\"a\\\"b\",engine=\"0\"} 3\n\
             x_total{model_name=\"a\\\"b\",engine=\"1\"} 4\n\
             y{model_name=\"a\\\"b\",engine=\"0\",k=\"v\"} 1.5\n"
        );
    }
}
