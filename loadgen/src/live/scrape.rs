//! Fleet-wide counters from Prometheus `/metrics` pages, read before and after a run so the
//! report can use their deltas: every replica's `vllm:prefix_cache_hits_total`,
//! `vllm:prefix_cache_queries_total` and `vllm:prompt_tokens_total` (vLLM and kvroute agents
//! both export them), and the router's `kvroute_router_{predicted,realized}_cached_tokens_total`,
//! `kvroute_router_prompt_tokens_total` and its tokenizer cache's
//! `kvroute_router_tokenize_{reused,tokenized}_bytes_total`; and the names of the router's
//! replicas (the `replica` label of `kvroute_router_replica_requests_total`) and which of
//! them it can route to (`kvroute_router_replica_state{state="eligible"}`), so a replica
//! that could have had requests but got none still counts in the load skew.
//!
//! A run's figures are the deltas of these counters ([`ReplicaCounters::since`],
//! [`RouterCounters::since`]): a counter that went backwards, or a replica whose process start
//! time (`process_start_time_seconds`) changed, gives none (it restarted, and what it counted
//! before that is lost), and a replica without them counts as unread.
//!
//! Samples are read with [`kvroute_proto::prometheus`]; those of one name are summed over
//! their label sets (e.g. vLLM's per-engine labels).

use std::time::Duration;

use serde::Serialize;

pub use kvroute_proto::prometheus::sum;
use kvroute_proto::prometheus::{label_values, samples};

use super::client::Client;

/// How long one scrape may take.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// One replica's prefix-cache counters at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ReplicaCounters {
    pub prefix_cache_hits: f64,
    pub prefix_cache_queries: f64,
    pub prompt_tokens: f64,
    /// When the replica's process started (`process_start_time_seconds`, Unix seconds), if
    /// its page says: vLLM's, through Prometheus' Python client, and kvroute agents' do.
    pub started: Option<f64>,
}

impl ReplicaCounters {
    /// `None` unless the page has all three series: a page without them (an SGLang engine,
    /// a wrong URL answering 200, a vLLM too old to count prefix-cache queries) says
    /// nothing about the replica's cache, and reading it as zeros would put a replica that
    /// did serve requests into the fleet's hit rate as one that served none.
    ///
    /// Hits count the tokens loaded from outside the cache (vLLM's
    /// `external_prefix_cache_hits`: host memory it offloaded to, a KV connector), as the
    /// responses' `cached_tokens` do; a page without that series had none.
    fn parse(page: &str) -> Option<Self> {
        let external = sum(page, "vllm:external_prefix_cache_hits_total").unwrap_or(0.0);
        Some(Self {
            prefix_cache_hits: sum(page, "vllm:prefix_cache_hits_total")? + external,
            prefix_cache_queries: sum(page, "vllm:prefix_cache_queries_total")?,
            prompt_tokens: sum(page, "vllm:prompt_tokens_total")?,
            started: sum(page, "process_start_time_seconds"),
        })
    }

    /// `self - before`, counter by counter as `delta` says; `None` if the replica restarted
    /// between the reads (its start time changed, or a counter went backwards: a restart that
    /// counted past the earlier read again shows only in the start time) or more tokens hit
    /// than were looked up: each counter checked on its own would let a restart that reset
    /// one but not another (hits 0 to 800, queries 1000 to 1000) count 800 hits in 0 queries.
    pub fn since(&self, before: &Self) -> Option<Self> {
        if let (Some(now), Some(then)) = (self.started, before.started)
            && now != then
        {
            return None;
        }
        let d = Self {
            prefix_cache_hits: delta(self.prefix_cache_hits, before.prefix_cache_hits)?,
            prefix_cache_queries: delta(self.prefix_cache_queries, before.prefix_cache_queries)?,
            prompt_tokens: delta(self.prompt_tokens, before.prompt_tokens)?,
            started: self.started,
        };
        (d.prefix_cache_hits <= d.prefix_cache_queries).then_some(d)
    }
}

/// The increase of a counter between two reads, `None` if it went backwards (or is not a
/// number): its process restarted in between, so what it counted before that is lost and
/// the increase is unknown. (A restart that counted past the earlier read again shows only in
/// a replica's start time.)
fn delta(after: f64, before: f64) -> Option<f64> {
    let d = after - before;
    (d.is_finite() && d >= 0.0).then_some(d)
}

/// The router's prediction counters at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RouterCounters {
    pub predicted_cached_tokens: f64,
    pub realized_cached_tokens: f64,
    pub prompt_tokens: f64,
    /// Prompt tokens, and predicted cached tokens, of the requests whose answer reported its
    /// cached tokens: `realized_cached_tokens`' own denominator and the prediction to set
    /// beside it (an error, or a stream without `include_usage`, reports none).
    pub reported_prompt_tokens: f64,
    pub reported_predicted_cached_tokens: f64,
    /// Prompt text bytes whose token ids came from the router's prefix cache.
    pub tokenize_reused_bytes: f64,
    /// Prompt text bytes the router tokenized.
    pub tokenize_tokenized_bytes: f64,
    /// Waits for room in the router's line (`--max-queued`; a request may wait twice: for a
    /// place under `--max-in-flight`, then for a replica), and their time in all, seconds.
    pub queue_waits: f64,
    pub queue_wait_seconds: f64,
}

impl RouterCounters {
    /// `None` when the page is not a kvroute router's.
    fn parse(page: &str) -> Option<Self> {
        Some(Self {
            predicted_cached_tokens: sum(page, "kvroute_router_predicted_cached_tokens_total")?,
            realized_cached_tokens: sum(page, "kvroute_router_realized_cached_tokens_total").unwrap_or(0.0),
            prompt_tokens: sum(page, "kvroute_router_prompt_tokens_total").unwrap_or(0.0),
            reported_prompt_tokens: sum(page, "kvroute_router_reported_prompt_tokens_total").unwrap_or(0.0),
            reported_predicted_cached_tokens: sum(
                page,
                "kvroute_router_reported_predicted_cached_tokens_total",
            )
            .unwrap_or(0.0),
            tokenize_reused_bytes: sum(page, "kvroute_router_tokenize_reused_bytes_total").unwrap_or(0.0),
            tokenize_tokenized_bytes: sum(page, "kvroute_router_tokenize_tokenized_bytes_total")
                .unwrap_or(0.0),
            queue_waits: sum(page, "kvroute_router_queue_wait_seconds_count").unwrap_or(0.0),
            queue_wait_seconds: sum(page, "kvroute_router_queue_wait_seconds_sum").unwrap_or(0.0),
        })
    }

    /// `self - before`, counter by counter as `delta` says (the replicas' rule); `None` if
    /// any counter went backwards (the router restarted between the reads).
    pub fn since(&self, before: &Self) -> Option<Self> {
        Some(Self {
            predicted_cached_tokens: delta(self.predicted_cached_tokens, before.predicted_cached_tokens)?,
            realized_cached_tokens: delta(self.realized_cached_tokens, before.realized_cached_tokens)?,
            prompt_tokens: delta(self.prompt_tokens, before.prompt_tokens)?,
            reported_prompt_tokens: delta(self.reported_prompt_tokens, before.reported_prompt_tokens)?,
            reported_predicted_cached_tokens: delta(
                self.reported_predicted_cached_tokens,
                before.reported_predicted_cached_tokens,
            )?,
            tokenize_reused_bytes: delta(self.tokenize_reused_bytes, before.tokenize_reused_bytes)?,
            tokenize_tokenized_bytes: delta(self.tokenize_tokenized_bytes, before.tokenize_tokenized_bytes)?,
            queue_waits: delta(self.queue_waits, before.queue_waits)?,
            queue_wait_seconds: delta(self.queue_wait_seconds, before.queue_wait_seconds)?,
        })
    }

    /// Waits for room at the router, and their mean, seconds (none if nothing waited).
    pub fn queue_waits(&self) -> Option<(f64, f64)> {
        (self.queue_waits > 0.0).then(|| (self.queue_waits, self.queue_wait_seconds / self.queue_waits))
    }

    /// The share of prompt text the router's tokenizer cache saved it tokenizing.
    pub fn tokenize_reuse(&self) -> Option<f64> {
        let total = self.tokenize_reused_bytes + self.tokenize_tokenized_bytes;
        (total > 0.0).then(|| self.tokenize_reused_bytes / total)
    }
}

/// Every counter the run reads, at one instant; a page that could not be read, or has not
/// the counters, is `None`.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub replicas: Vec<Option<ReplicaCounters>>,
    pub router: Option<RouterCounters>,
    /// The names of the replicas behind the router (empty when the target is no kvroute
    /// router or its page could not be read): the names its `x-kvroute-replica` header uses.
    /// Every member is listed, draining or not serving ones too.
    pub router_replicas: Vec<String>,
    /// Those of `router_replicas` the router could route to (`state="eligible"`); `None`
    /// when its page has no state series.
    pub router_eligible: Option<Vec<String>>,
}

/// The router's series naming each replica it routes to.
const ROUTER_REPLICA_SERIES: &str = "kvroute_router_replica_requests_total";

/// The router's series giving each replica's routing state: 1 under the label `state` it is
/// in (`eligible`, or why not: `draining`, `not_serving`, `unhealthy`, ...).
const ROUTER_STATE_SERIES: &str = "kvroute_router_replica_state";

/// The replicas whose routing state is `eligible` on a router's page, `None` if the page has
/// no state series.
fn eligible_replicas(page: &str) -> Option<Vec<String>> {
    let mut any = false;
    let mut out = Vec::new();
    for sample in samples(page, ROUTER_STATE_SERIES) {
        any = true;
        if sample.value == 1.0
            && sample.label("state") == Some("eligible")
            && let Some(name) = sample.label("replica")
            && !out.iter().any(|n| n == name)
        {
            out.push(name.to_owned());
        }
    }
    any.then_some(out)
}

/// Reads `{url}/metrics` of every replica and of the target (a router's page has the router
/// counters; a replica's has none). A page that cannot be read, or a replica's without its
/// counters, is logged and left out.
pub async fn snapshot(client: &Client, target: &str, replicas: &[String]) -> Snapshot {
    let page = |url: String| async move {
        match client.get(&format!("{url}/metrics"), SCRAPE_TIMEOUT).await {
            Ok((status, body)) if status.is_success() => Some(String::from_utf8_lossy(&body).into_owned()),
            Ok((status, _)) => {
                tracing::warn!(%url, %status, "metrics scrape refused");
                None
            }
            Err(kind) => {
                tracing::warn!(%url, error = kind.label(), "metrics scrape failed");
                None
            }
        }
    };
    let mut out = Snapshot::default();
    for url in replicas {
        let counters = page(url.clone()).await.and_then(|p| {
            let counters = ReplicaCounters::parse(&p);
            if counters.is_none() {
                tracing::warn!(%url, "metrics page without vLLM's prefix-cache and prompt counters");
            }
            counters
        });
        out.replicas.push(counters);
    }
    if let Some(page) = page(target.to_owned()).await {
        out.router = RouterCounters::parse(&page);
        out.router_replicas = label_values(&page, ROUTER_REPLICA_SERIES, "replica");
        out.router_eligible = eligible_replicas(&page);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_samples_over_labels_and_skips_lookalikes() {
        let page = "# HELP vllm:prefix_cache_hits_total x\n# TYPE vllm:prefix_cache_hits_total counter\n\
                    vllm:prefix_cache_hits_total{model_name=\"m\",engine=\"0\"} 10\n\
                    vllm:prefix_cache_hits_total{model_name=\"m\",engine=\"1\"} 5.5 1700000000\n\
                    vllm:prefix_cache_hits_total_created 3\n\
                    vllm:prefix_cache_queries_total 40\n";
        assert_eq!(sum(page, "vllm:prefix_cache_hits_total"), Some(15.5));
        assert_eq!(sum(page, "vllm:prefix_cache_queries_total"), Some(40.0));
        assert_eq!(sum(page, "vllm:prompt_tokens_total"), None);
        assert_eq!(RouterCounters::parse(page), None);
        let router = "kvroute_router_predicted_cached_tokens_total 7\n\
                      kvroute_router_reported_prompt_tokens_total 40\n\
                      kvroute_router_reported_predicted_cached_tokens_total 6\n\
                      kvroute_router_tokenize_reused_bytes_total 300\n\
                      kvroute_router_tokenize_tokenized_bytes_total 100\n\
                      kvroute_router_queue_wait_seconds_sum 1.5\n\
                      kvroute_router_queue_wait_seconds_count 3\n\
                      kvroute_router_queue_wait_seconds_bucket{le=\"+Inf\"} 3\n";
        let router = RouterCounters::parse(router).unwrap();
        // The realized rate's own denominator and prediction, beside the routed ones.
        assert_eq!((router.reported_prompt_tokens, router.reported_predicted_cached_tokens), (40.0, 6.0));
        assert_eq!(router.tokenize_reuse(), Some(0.75));
        assert_eq!(router.queue_waits(), Some((3.0, 0.5)), "three waits of half a second on average");
        let since = router.since(&router).unwrap();
        assert_eq!((since.tokenize_reuse(), since.queue_waits()), (None, None));
        let with_prompts = format!("{page}vllm:prompt_tokens_total 0\n");
        let before = ReplicaCounters::parse(&with_prompts).unwrap();
        let after = ReplicaCounters {
            prefix_cache_hits: 20.0,
            prefix_cache_queries: 50.0,
            prompt_tokens: 5.0,
            started: None,
        };
        let since = ReplicaCounters { prefix_cache_hits: 4.5, prefix_cache_queries: 10.0, ..after };
        assert_eq!(after.since(&before), Some(since));
    }

    /// Regression: a page without vLLM's series (an SGLang engine, a wrong URL answering
    /// 200) was read as a replica with every counter at zero.
    #[test]
    fn a_page_without_the_replica_counters_is_unread() {
        assert_eq!(ReplicaCounters::parse("sglang:prompt_tokens_total 100\n"), None);
        assert_eq!(ReplicaCounters::parse("<html>not found</html>"), None);
        // A vLLM without the prefix-cache counters says nothing about its cache either.
        assert_eq!(ReplicaCounters::parse("vllm:prompt_tokens_total 100\n"), None);
    }

    /// Tokens an engine loaded from host memory (or another KV connector) are hits, as its
    /// responses' `cached_tokens` count them.
    #[test]
    fn external_hits_count() {
        let page = "vllm:prefix_cache_hits_total 10
vllm:prefix_cache_queries_total 40
                    vllm:prompt_tokens_total 40
";
        let local = ReplicaCounters::parse(page).expect("read");
        assert_eq!(local.prefix_cache_hits, 10.0, "none said: none");
        let page = format!(
            "{page}vllm:external_prefix_cache_hits_total{{engine=\"0\"}} 12
"
        );
        assert_eq!(ReplicaCounters::parse(&page).expect("read").prefix_cache_hits, 22.0);
    }

    /// Regression: each counter was checked for a reset on its own, so a restart that reset
    /// the hits but not the queries gave 800 hits in 0 queries; and the router's counters
    /// used another rule (clamp to 0) than the replicas'.
    #[test]
    fn a_counter_that_went_backwards_is_no_delta() {
        let at = |hits, queries, prompt_tokens| ReplicaCounters {
            prefix_cache_hits: hits,
            prefix_cache_queries: queries,
            prompt_tokens,
            started: None,
        };
        assert_eq!(at(800.0, 1000.0, 1000.0).since(&at(0.0, 1000.0, 1000.0)), None);
        assert_eq!(at(10.0, 20.0, 20.0).since(&at(500.0, 1000.0, 1000.0)), None);
        assert_eq!(at(10.0, 20.0, 5.0).since(&at(0.0, 0.0, 10.0)), None);
        assert_eq!(at(10.0, 20.0, 20.0).since(&at(0.0, 0.0, 0.0)), Some(at(10.0, 20.0, 20.0)));
        let router =
            |predicted| RouterCounters { predicted_cached_tokens: predicted, ..RouterCounters::default() };
        assert_eq!(router(5.0).since(&router(10.0)), None);
        assert_eq!(router(10.0).since(&router(5.0)), Some(router(5.0)));
    }

    /// Regression: a replica that restarted between the reads and counted past the first read
    /// again gave a delta of its counts since the restart alone, as if for the whole run.
    #[test]
    fn a_replica_that_restarted_is_no_delta() {
        let page = |started: &str, hits| {
            format!(
                "vllm:prefix_cache_hits_total {hits}\nvllm:prefix_cache_queries_total {}\n\
                 vllm:prompt_tokens_total 900\n{started}",
                2 * hits
            )
        };
        let read = |page: String| ReplicaCounters::parse(&page).unwrap();
        let before = read(page("process_start_time_seconds 1.7e9\n", 100));
        assert_eq!(before.started, Some(1.7e9));
        let restarted = read(page("process_start_time_seconds 1.7000001e9\n", 600));
        assert_eq!(restarted.since(&before), None, "it counted past the first read again");
        let same = read(page("process_start_time_seconds 1.7e9\n", 600));
        assert_eq!(same.since(&before).map(|d| d.prefix_cache_hits), Some(500.0));
        // A page without a start time says nothing of a restart: the counters' rule alone.
        let unsaid = read(page("", 600));
        assert_eq!(unsaid.since(&before).map(|d| d.prefix_cache_hits), Some(500.0));
    }

    #[test]
    fn label_values_are_unescaped_and_listed_once() {
        let page = "# TYPE kvroute_router_replica_requests counter\n\
                    kvroute_router_replica_requests_total{replica=\"a\"} 3\n\
                    kvroute_router_replica_requests_total{zone=\"x,y\",replica=\"b \\\"q\\\" \\\\\"} 0\n\
                    kvroute_router_replica_requests_total{replica=\"a\"} 1\n\
                    kvroute_router_replica_requests_total_created{replica=\"c\"} 1\n\
                    kvroute_router_replica_requests_total{replica=\"unterminated} 1\n";
        assert_eq!(label_values(page, ROUTER_REPLICA_SERIES, "replica"), ["a", "b \"q\" \\"]);
        assert_eq!(label_values(page, ROUTER_REPLICA_SERIES, "zone"), ["x,y"]);
        assert!(label_values(page, "kvroute_router_other", "replica").is_empty());
    }

    #[test]
    fn eligible_replicas_are_those_in_the_eligible_state() {
        let page = "kvroute_router_replica_state{replica=\"a\",state=\"eligible\"} 1\n\
                    kvroute_router_replica_state{replica=\"b\",state=\"draining\"} 1\n\
                    kvroute_router_replica_state{state=\"eligible\",replica=\"c\"} 1\n\
                    kvroute_router_replica_state{replica=\"d\",state=\"eligible\"} 0\n\
                    kvroute_router_replica_state_other{replica=\"e\",state=\"eligible\"} 1\n";
        assert_eq!(eligible_replicas(page), Some(vec!["a".to_string(), "c".to_string()]));
        assert_eq!(eligible_replicas("kvroute_router_replica_requests_total{replica=\"a\"} 1\n"), None);
    }
}
