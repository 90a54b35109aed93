//! Active health checks: every `--health-interval-ms`, `GET /health` on each replica (a
//! replica that fails `--unhealthy-after` in a row, no 2xx within `--health-timeout-ms`, is
//! unhealthy until one passes; while no replica is up, one whose checks only went unanswered
//! in time is still tried: [`super::upstream::verdicts`]), then `GET /metrics` to read the
//! requests the replica reports waiting and running (`vllm:num_requests_waiting` and
//! `_running`, which both vLLM and the kvroute agent export; SGLang's `sglang:num_queue_reqs`
//! and `num_running_reqs`): what is beyond this router's own in-flight requests then is
//! [`crate::policy::Load::others`]. A check that reads no report clears it. A data-parallel
//! replica's ranks get theirs from the samples labelled by rank (vLLM's `engine="r"`,
//! SGLang's `dp_rank="r"`; [`crate::index::Ranks::set_reported`]). A healthy replica
//! is then given the LoRA adapters loaded through the router that it lacks
//! ([`super::lora::catch_up`]).
//!
//! Adapters loaded by anyone else (another router in front of the same fleet, an operator
//! on a replica itself) are learned from the replicas: each check also reads a healthy vLLM
//! or kvroute replica's `GET /v1/models` (the cards with a `parent` are adapters). An
//! adapter any replica lists is hashed in its own namespace from then on, as the replicas
//! hash it, and listed in the router's `/v1/models` (up to [`MAX_LEARNED_ADAPTERS`]); one
//! that no replica lists any more is forgotten (unless this router's configuration or its
//! own load named it). Without this, another router's adapter was hashed in the base model's
//! namespace, where the base model's cached prefixes gave it predicted hits it never had.
//! An adapter's requests go only to replicas whose last list has it
//! ([`super::upstream::Adapter::Listed`]): a fleet may serve different adapters on different
//! replicas, and a replica without one answers its requests 404. SGLang replicas, and
//! replicas that refuse the list (vLLM's `--api-key`, when the router has no
//! `--replica-api-key` to show them), tell nothing here, and may be sent any adapter's requests.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use kvroute_proto::openai::Tokenization;
use kvroute_proto::prometheus;
use tokio_util::sync::CancellationToken;

use super::ProxyState;
use super::body::full;
use super::control::Client;
use super::lora::catch_up;
use super::upstream::{Check, Upstream};
use crate::fleet::{Fleet, Member};
use crate::replicas::EngineKind;

/// How the checks run.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    pub interval: Duration,
    /// For each of `/health`, `/metrics` and `/v1/models`.
    pub timeout: Duration,
    /// For giving a replica an adapter it lacks ([`catch_up`]).
    pub load_timeout: Duration,
    pub unhealthy_after: u32,
}

/// Checks every replica of the proxy's fleet each `settings.interval` until `shutdown` fires.
/// Each replica's check runs on its own: one whose check is still under way at a tick (a
/// replica slow to answer, up to each read's timeout) is not checked again then, and holds
/// up no other's. (A round waited for all: one slow replica left every other's load report
/// that much older, at the fleet's peak.) The adapters are learned from every replica's last
/// listing once the checks begun at a tick are over, and at each tick.
pub async fn run(state: Arc<ProxyState>, client: Client, settings: Settings, shutdown: CancellationToken) {
    let fleet = state.fleet();
    let mut learned = Learned::default();
    let mut tick = tokio::time::interval(settings.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The checks under way, each with the replica it checks; every replica's last listing.
    // A replica is its upstream: one replaced under the same name (a pod at a new address)
    // is checked at once, and what a check of the old one says is dropped. (A listing holds
    // its upstream, so that no other can take its address while the listing is kept.)
    let mut under_way = futures::stream::FuturesUnordered::new();
    let mut checking = HashSet::new();
    let mut listings: HashMap<usize, (Arc<Upstream>, HashSet<String>)> = HashMap::new();
    let key = |member: &Member| Arc::as_ptr(&member.upstream) as usize;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            Some((checked, upstream, listed)) = under_way.next(), if !under_way.is_empty() => {
                checking.remove(&checked);
                let current = fleet.members().iter().any(|m| key(m) == checked);
                match listed {
                    Listing::Listed(listed) if current => drop(listings.insert(checked, (upstream, listed))),
                    Listing::Unchanged if current => {}
                    _ => drop(listings.remove(&checked)),
                };
                // The round's last: learned from at once, as the tick would a round later.
                if checking.is_empty() {
                    learn_adapters(&state, &listings, &mut learned);
                    learn_context(&state);
                }
                continue;
            }
            () = shutdown.cancelled() => return,
        }
        let members = fleet.members();
        listings.retain(|checked, _| members.iter().any(|m| key(m) == *checked));
        for member in members {
            let checked = key(&member);
            if checking.insert(checked) {
                let client = &client;
                let upstream = member.upstream.clone();
                under_way
                    .push(async move { (checked, upstream, check(member, fleet, client, settings).await) });
            }
        }
        // (Those of a replica still under way from an earlier tick: its last listing stands.)
        learn_adapters(&state, &listings, &mut learned);
    }
}

/// Takes the model's context length from the replicas' cards (vLLM's `max_model_len`): what
/// `truncate_prompt_tokens: -1` keeps, less the output tokens.
fn learn_context(state: &ProxyState) {
    let card = super::served_card(state);
    if let Some(tokens) = card.and_then(|card| card.get("max_model_len")?.as_u64()) {
        state.decider.prompts.tokenization().set_context_len(tokens);
    }
}

/// The most LoRA adapters learned from the replicas' lists: a replica could list any number
/// (vLLM keeps `--max-cpu-loras` of them, its default `--max-loras`, 1), and each is a cache
/// namespace and an entry in the router's `/v1/models`.
const MAX_LEARNED_ADAPTERS: usize = 1024;

/// The adapters learned from the replicas' lists.
#[derive(Debug, Default)]
struct Learned {
    names: HashSet<String>,
    /// That the lists name more than [`MAX_LEARNED_ADAPTERS`] has been said (once).
    warned: bool,
}

/// Takes the adapters that any replica in `listings` (each one's last) has, and forgets
/// those it `learned` that none has any more (see the module docs); takes an adapter loaded
/// through the router that a replica has (its requests go only there).
fn learn_adapters(
    state: &ProxyState,
    listings: &HashMap<usize, (Arc<Upstream>, HashSet<String>)>,
    learned: &mut Learned,
) {
    let listed: Vec<&HashSet<String>> = listings.values().map(|(_, listed)| listed).collect();
    let tokenization = state.decider.prompts.tokenization();
    let members = state.fleet().members();
    let registry = state.fleet().adapters();
    // Not while a change runs: an unload could end the namespace between the checks and the
    // add (the next tick sees to it).
    if let Some(_turn) = registry.between_changes() {
        for adapter in registry.all() {
            if members.iter().any(|m| m.upstream.has_adapter(&adapter.name))
                && tokenization.add_lora_adapter(&adapter.name)
            {
                tracing::info!(
                    lora_name = adapter.name,
                    "LoRA adapter a replica now has: hashed in its namespace"
                );
            }
        }
    }
    learned.update(tokenization, &listed, |name| state.fleet().adapters().contains(name));
}

impl Learned {
    /// Learns the adapters of `listed` (the replicas' last lists) that `tokenization` does not
    /// know, up to [`MAX_LEARNED_ADAPTERS`]; forgets those learned that no list has any more
    /// and `keep` does not keep (loaded through the router). Nothing when nothing is listed.
    fn update(
        &mut self,
        tokenization: &Tokenization,
        listed: &[&HashSet<String>],
        keep: impl Fn(&str) -> bool,
    ) {
        if listed.is_empty() {
            return;
        }
        let mut capped = false;
        for name in listed.iter().flat_map(|listed| listed.iter()) {
            if tokenization.is_lora_adapter(name) || name == tokenization.base_model() {
                continue;
            }
            if self.names.len() >= MAX_LEARNED_ADAPTERS {
                capped = true;
                continue;
            }
            tokenization.add_lora_adapter(name);
            tracing::info!(lora_name = name, "LoRA adapter a replica lists: hashed in its namespace");
            self.names.insert(name.clone());
        }
        if capped && !self.warned {
            self.warned = true;
            tracing::warn!(
                max = MAX_LEARNED_ADAPTERS,
                "the replicas list more LoRA adapters than the router learns: the others' requests \
                 are hashed in the base model's namespace and sent to any replica"
            );
        }
        self.names.retain(|name| {
            let kept = listed.iter().any(|l| l.contains(name)) || keep(name);
            if !kept {
                tokenization.remove_lora_adapter(name);
                tracing::info!(lora_name = name, "LoRA adapter no replica lists any more: forgotten");
            }
            kept
        });
    }
}

/// What a check says of a replica's LoRA adapters.
enum Listing {
    /// The adapters it lists.
    Listed(HashSet<String>),
    /// None known: it is unhealthy, or its list could not be read (it may have any).
    Unknown,
    /// Its check was late (busy, not down): its last listing stands, as its last load
    /// report does.
    Unchanged,
}

/// Checks `member`; returns the adapters it lists, if it is healthy and said.
async fn check(member: Member, fleet: &Fleet, client: &Client, settings: Settings) -> Listing {
    let Settings { timeout, load_timeout, unhealthy_after, .. } = settings;
    let base = &member.replica.spec.http_url;
    let check = match fetch(client, &format!("{base}/health"), timeout).await {
        Ok((status, _)) if status.is_success() => Check::Passed,
        Ok(_) => Check::Failed,
        Err(check) => check,
    };
    let passed = check == Check::Passed;
    let (was, was_late) = (member.upstream.passes_checks(), member.upstream.is_late());
    let healthy = member.upstream.record_check(check, unhealthy_after);
    if healthy != was {
        tracing::info!(replica = %member.replica.spec.name, healthy, "replica health changed");
    }
    // Back from failed checks (not late ones: busy), it may have restarted and lost the
    // adapters loaded on it: they are loaded again below. (SGLang's metrics say no start time,
    // nor does it list its adapters: this is the only sign of its restart.)
    if healthy && !was && !was_late {
        member.upstream.forget_adapters();
    }
    // A replica without events unhealthy and failing its checks (not late: busy) will come
    // back with an empty cache (each such check: it may have turned unhealthy on late ones,
    // then crashed).
    let prediction = member.replica.prediction.get();
    if let Some(prediction) = prediction.filter(|_| !healthy && check == Check::Failed) {
        prediction.forget();
    }
    // A late check asks nothing more, and changes nothing it would have read: a busy
    // replica's load report (the other routers' requests there) and adapters (routed to it)
    // stand. Dropped, its load looked the router's alone, and its adapters forgotten.
    if check == Check::Late {
        return Listing::Unchanged;
    }
    // A check that failed asks nothing more (a replica that does not answer would go
    // unchecked for every read's timeout).
    let healthy = healthy && passed;
    // This router's own requests during the scrape: those in flight as it begins and those
    // sent meanwhile are the most the report can hold of them.
    let mark = member.upstream.report_mark();
    let ranks = member.replica.ranks.get();
    let rank_marks = ranks.map(|ranks| ranks.report_marks());
    let page = match healthy {
        true => match get(client, &format!("{base}/metrics"), timeout).await {
            Some((status, body)) if status.is_success() => Some(body),
            _ => None,
        },
        false => None,
    };
    let page = page.as_deref().unwrap_or_default();
    // One that restarted between two checks reports a new start time (vLLM's metrics do,
    // SGLang's not): it lost its adapters (loaded again below), and its cache (predicted,
    // bounded by its size).
    let started = start_time(page);
    if let Some(started) = started
        && member.upstream.note_start(started)
    {
        tracing::info!(replica = %member.replica.spec.name, "replica restarted: its LoRA adapters are loaded again");
    }
    if let Some(prediction) = prediction {
        if let Some(started) = started {
            prediction.started(started);
        }
        let block_size = member.replica.spec.block_size.unwrap_or(1);
        if let Some(blocks) = cache_blocks(page, block_size) {
            prediction.set_capacity(blocks);
        }
    }
    let report = match (gauge_sum(page, &WAITING_GAUGES), gauge_sum(page, &RUNNING_GAUGES)) {
        (None, None) => None,
        (waiting, running) => Some((waiting.unwrap_or(0), running.unwrap_or(0))),
    };
    member.upstream.set_reported(report, mark);
    // Each rank's, where the replica labels them by rank.
    if let (Some(ranks), Some(marks)) = (ranks, rank_marks) {
        let label = rank_label(member.replica.spec.engine);
        ranks.set_reported(&marks, |rank| {
            let (waiting, running) = (
                rank_gauge_sum(page, &WAITING_GAUGES, (label, rank)),
                rank_gauge_sum(page, &RUNNING_GAUGES, (label, rank)),
            );
            waiting.or(running).map(|_| waiting.unwrap_or(0).saturating_add(running.unwrap_or(0)))
        });
    }
    if !healthy {
        return Listing::Unknown;
    }
    let listing = match member.replica.spec.engine {
        EngineKind::Sglang => None,
        EngineKind::Vllm | EngineKind::Kvroute => {
            get(client, &format!("{base}/v1/models"), timeout).await.filter(|(status, _)| status.is_success())
        }
    };
    let cards = listing.as_ref().and_then(|(_, body)| catch_up::model_cards(body));
    // The served model's card, for the fleet's `/v1/models` (its context length, say).
    if let Some(card) = cards.as_ref().and_then(|cards| {
        cards.iter().find(|card| card.parent.is_none() && card.id == member.replica.spec.model)
    }) {
        member.upstream.set_card(card.fields());
    }
    // The adapters: the cards with a parent model.
    let adapters: Option<HashSet<String>> = cards
        .as_ref()
        .map(|cards| cards.iter().filter(|card| card.parent.is_some()).map(|card| card.id.clone()).collect());
    // (None when this healthy replica's list could not be read: one restarted with an API
    // key, or as another engine, lists nothing now, and may have any adapter.)
    member.upstream.set_listed_adapters(adapters.clone());
    let timeouts = catch_up::Timeouts { list: timeout, load: load_timeout };
    let listed = cards.map(|cards| cards.into_iter().map(|card| card.id).collect());
    // Not for a replica replaced meanwhile under its name (its id): the new one's catch-up
    // is the one to run.
    if fleet.still_has(&member) {
        catch_up::spawn(fleet, member, client, timeouts, listed);
    }
    adapters.map_or(Listing::Unknown, Listing::Listed)
}

async fn get(client: &Client, url: &str, timeout: Duration) -> Option<(http::StatusCode, Bytes)> {
    fetch(client, url, timeout).await.ok()
}

/// [`get`], or why there is no answer: [`Check::Late`] when none came in time.
async fn fetch(client: &Client, url: &str, timeout: Duration) -> Result<(http::StatusCode, Bytes), Check> {
    let request = http::Request::get(url).body(full(Bytes::new())).map_err(|_| Check::Failed)?;
    let response = tokio::time::timeout(timeout, client.request(request))
        .await
        .map_err(|_| Check::Late)?
        .map_err(|_| Check::Failed)?;
    let status = response.status();
    let body = super::body::read_at_most(response.into_body(), super::body::REPLICA_ANSWER_BYTES);
    let body =
        tokio::time::timeout(timeout, body).await.map_err(|_| Check::Late)?.map_err(|_| Check::Failed)?;
    Ok((status, body))
}

/// The gauges engines report their waiting requests in: vLLM's (and the agent's), SGLang's.
const WAITING_GAUGES: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
/// And their running ones.
const RUNNING_GAUGES: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];

/// `vllm:num_requests_waiting{...} 3` → 3 for `gauges` naming it (summed over label sets, e.g.
/// per engine); `None` when no gauge is there.
fn gauge_sum(metrics: &[u8], gauges: &[&str]) -> Option<u32> {
    gauge_sum_of(metrics, gauges, |_| true)
}

/// The replica's start time (unix seconds), as Prometheus' Python client reports its
/// process's (vLLM, SGLang) and the replica agent its own.
fn start_time(metrics: &[u8]) -> Option<f64> {
    let page = std::str::from_utf8(metrics).ok()?;
    prometheus::samples(page, "process_start_time_seconds").next().map(|sample| sample.value)
}

/// The replica's KV cache, in blocks of `block_size` tokens, as its metrics page says it:
/// vLLM's `vllm:cache_config_info` (its labels `num_gpu_blocks` and `block_size`; the
/// largest sample: vLLM writes its engines' total once per engine), SGLang's `sglang:max_total_num_tokens`, the agent's
/// `kvroute_agent_capacity_blocks` (its blocks are the router's size). 0 for a vLLM without
/// prefix caching (`enable_prefix_caching="False"`): it keeps nothing for later requests.
fn cache_blocks(metrics: &[u8], block_size: u32) -> Option<usize> {
    let page = std::str::from_utf8(metrics).ok()?;
    if prometheus::samples(page, "vllm:cache_config_info")
        .any(|sample| sample.label("enable_prefix_caching") == Some("False"))
    {
        return Some(0);
    }
    let label = |sample: &prometheus::Sample, name| sample.label(name)?.parse::<u64>().ok();
    let vllm = prometheus::samples(page, "vllm:cache_config_info")
        .map(|sample| label(&sample, "num_gpu_blocks")?.checked_mul(label(&sample, "block_size")?))
        .try_fold(0u64, |most, tokens| Some(most.max(tokens?)));
    let tokens = vllm.filter(|&tokens| tokens > 0).or_else(|| {
        let sum = |name| prometheus::samples(page, name).map(|sample| sample.value).reduce(|a, b| a + b);
        (sum("sglang:max_total_num_tokens"))
            .or_else(|| sum("kvroute_agent_capacity_blocks").map(|blocks| blocks * f64::from(block_size)))
            .map(|tokens| tokens as u64)
    })?;
    usize::try_from(tokens / u64::from(block_size.max(1))).ok().filter(|&blocks| blocks > 0)
}

/// The label an engine names a data-parallel rank's series by: vLLM's engine index (the
/// agent's too), SGLang's `dp_rank` (0.4.10 on; its lead scheduler of each rank reports).
fn rank_label(engine: EngineKind) -> &'static str {
    match engine {
        EngineKind::Sglang => "dp_rank",
        EngineKind::Vllm | EngineKind::Kvroute => "engine",
    }
}

/// [`gauge_sum`] of the samples labelled `label="rank"`.
fn rank_gauge_sum(metrics: &[u8], gauges: &[&str], (label, rank): (&str, u32)) -> Option<u32> {
    let rank = rank.to_string();
    gauge_sum_of(metrics, gauges, |sample| sample.label(label) == Some(rank.as_str()))
}

/// The sum of the samples of `gauges` that pass `keep`, as a count: of SGLang's, its lead
/// scheduler's (`tp_rank` and `pp_rank` 0). With `--enable-metrics-for-all-schedulers` every
/// scheduler of a rank reports the same requests, and the sum counted them once a scheduler.
fn gauge_sum_of(metrics: &[u8], gauges: &[&str], keep: impl Fn(&prometheus::Sample) -> bool) -> Option<u32> {
    let page = std::str::from_utf8(metrics).ok()?;
    let lead = |sample: &prometheus::Sample| {
        ["tp_rank", "pp_rank"].iter().all(|label| sample.label(label).is_none_or(|rank| rank == "0"))
    };
    let kept = |sample: &prometheus::Sample| lead(sample) && keep(sample);
    let values = gauges.iter().flat_map(|gauge| prometheus::samples(page, gauge).filter(kept));
    values.map(|sample| sample.value as u32).reduce(u32::saturating_add)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use kvroute_proto::openai::{Tokenization, TokenizationConfig};

    /// An adapter any replica lists is learned, up to the most the router learns; one no
    /// list has any more is forgotten, unless kept; one the router knew already is not its
    /// to forget.
    #[test]
    fn learns_what_any_replica_lists_up_to_a_bound() {
        let config = TokenizationConfig {
            base_model: "m".into(),
            lora_adapters: vec!["configured".into()],
            ..TokenizationConfig::default()
        };
        let tokenization = Tokenization::new(&config).unwrap();
        let mut learned = super::Learned::default();
        let names = |names: &[&str]| names.iter().map(|name| (*name).to_owned()).collect::<HashSet<_>>();
        let (one, other) = (names(&["sql", "configured"]), names(&["chat"]));
        learned.update(&tokenization, &[&one, &other], |_| false);
        assert_eq!(tokenization.lora_adapters(), ["chat", "configured", "sql"]);
        learned.update(&tokenization, &[&one, &other, &names(&["m"])], |_| false);
        assert_eq!(tokenization.lora_adapters(), ["chat", "configured", "sql"], "never the base model");
        learned.update(&tokenization, &[], |_| false);
        assert_eq!(tokenization.lora_adapters(), ["chat", "configured", "sql"], "no list: nothing forgotten");
        learned.update(&tokenization, &[&other], |name| name == "sql");
        assert_eq!(tokenization.lora_adapters(), ["chat", "configured", "sql"], "kept");
        learned.update(&tokenization, &[&other], |_| false);
        assert_eq!(tokenization.lora_adapters(), ["chat", "configured"]);

        let many: HashSet<String> = (0..super::MAX_LEARNED_ADAPTERS + 10).map(|i| format!("a{i}")).collect();
        learned.update(&tokenization, &[&many, &other], |_| false);
        assert_eq!(learned.names.len(), super::MAX_LEARNED_ADAPTERS);
        assert_eq!(
            tokenization.lora_adapters().len(),
            super::MAX_LEARNED_ADAPTERS + 1,
            "and the configured one"
        );
    }

    #[test]
    fn reported_waiting_saturates() {
        let page =
            "vllm:num_requests_waiting{engine=\"0\"} 4e9\nvllm:num_requests_waiting{engine=\"1\"} 4e9\n";
        assert_eq!(super::gauge_sum(page.as_bytes(), &super::WAITING_GAUGES), Some(u32::MAX));
    }

    #[test]
    fn reads_each_engines_requests() {
        let page = br#"vllm:num_requests_running{model_name="a \"engine=\"1\" b",engine="0"} 2
vllm:num_requests_running{model_name="m",engine="1"} 5 1700000000000
vllm:num_requests_waiting{engine="1",model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 9
vllm:num_requests_running{engine="2" 7
"#;
        let by = |gauges: &[&str], rank| super::rank_gauge_sum(page, gauges, ("engine", rank));
        assert_eq!((by(&super::RUNNING_GAUGES, 0), by(&super::WAITING_GAUGES, 0)), (Some(2), None));
        assert_eq!((by(&super::RUNNING_GAUGES, 1), by(&super::WAITING_GAUGES, 1)), (Some(5), Some(1)));
        assert_eq!(by(&super::RUNNING_GAUGES, 2), None, "a label set that does not end is passed over");
        assert_eq!(super::gauge_sum(page, &super::RUNNING_GAUGES), Some(7));
        assert_eq!(super::gauge_sum(page, &super::WAITING_GAUGES), Some(10));
        // SGLang's, by `dp_rank`, as its schedulers label them.
        let sglang = br#"sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="1"} 3
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="1"} 2
sglang:num_running_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="0"} 1
"#;
        let label = super::rank_label(super::EngineKind::Sglang);
        let by = |gauges: &[&str], rank| super::rank_gauge_sum(sglang, gauges, (label, rank));
        assert_eq!((by(&super::RUNNING_GAUGES, 1), by(&super::WAITING_GAUGES, 1)), (Some(3), Some(2)));
        assert_eq!(by(&super::RUNNING_GAUGES, 0), Some(1));
        // With `--enable-metrics-for-all-schedulers`, each scheduler of a rank reports its
        // requests: the lead's count, not their sum.
        let all = br#"sglang:num_running_reqs{model_name="m",tp_rank="0",pp_rank="0",dp_rank="0"} 4
sglang:num_running_reqs{model_name="m",tp_rank="1",pp_rank="0",dp_rank="0"} 4
sglang:num_running_reqs{model_name="m",tp_rank="0",pp_rank="1",dp_rank="0"} 4
sglang:num_running_reqs{model_name="m",tp_rank="0",pp_rank="0",dp_rank="1"} 2
sglang:num_running_reqs{model_name="m",tp_rank="1",pp_rank="0",dp_rank="1"} 2
"#;
        assert_eq!(super::gauge_sum(all, &super::RUNNING_GAUGES), Some(6));
        assert_eq!(super::rank_gauge_sum(all, &super::RUNNING_GAUGES, (label, 1)), Some(2));
    }

    #[test]
    fn reads_waiting_requests_from_prometheus_text() {
        let text = b"# HELP vllm:num_requests_waiting Requests waiting.\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"m\"} 3\nvllm:num_requests_waiting_total 9\n";
        assert_eq!(super::gauge_sum(text, &super::WAITING_GAUGES), Some(3));
        assert_eq!(super::gauge_sum(b"other 1\n", &super::WAITING_GAUGES), None);
    }

    #[test]
    fn reads_sglang_queues_and_values_before_timestamps() {
        let text = b"sglang:num_queue_reqs{model_name=\"a b} c\",engine_type=\"unified\"} 5 1700000000000\n\
                     sglang:num_queue_reqs_total 7\nsglang:num_running_reqs 9\n";
        assert_eq!(super::gauge_sum(text, &super::WAITING_GAUGES), Some(5));
    }

    /// A replica's cache size and start time, as vLLM, SGLang and the agent report them.
    #[test]
    fn reads_the_cache_size_and_the_start_time() {
        let vllm = br#"vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="3000",prefix_caching_hash_algo="sha256"} 1.0
process_start_time_seconds 1.73e+09
"#;
        assert_eq!(super::cache_blocks(vllm, 16), Some(3000));
        assert_eq!(super::cache_blocks(vllm, 32), Some(1500), "in the router's blocks");
        // Data-parallel: every engine's sample carries the engines' total.
        let dp = br#"vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="6000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="6000"} 1.0
"#;
        assert_eq!(super::cache_blocks(dp, 16), Some(6000));
        let uncached = br#"vllm:cache_config_info{block_size="16",enable_prefix_caching="False",num_gpu_blocks="3000"} 1.0
"#;
        assert_eq!(super::cache_blocks(uncached, 16), Some(0), "no prefix caching: nothing kept");
        let cached = br#"vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="3000"} 1.0
"#;
        assert_eq!(super::cache_blocks(cached, 16), Some(3000));
        let huge = br#"vllm:cache_config_info{block_size="18446744073709551615",num_gpu_blocks="2"} 1.0
"#;
        assert_eq!(super::cache_blocks(huge, 16), None, "an overflow is no size");
        assert_eq!(super::start_time(vllm), Some(1.73e9));
        let sglang = b"sglang:max_total_num_tokens{model_name=\"m\"} 640000\n";
        assert_eq!(super::cache_blocks(sglang, 64), Some(10_000));
        let agent = b"kvroute_agent_capacity_blocks{model_name=\"m\",engine=\"0\"} 4096\n";
        assert_eq!(super::cache_blocks(agent, 4), Some(4096));
        assert_eq!(super::cache_blocks(b"vllm:num_requests_waiting 1\n", 16), None);
        assert_eq!(super::start_time(agent), None);
    }
}
