//! Settings a reload changes while the router runs ([`crate::reload`]): what decisions route
//! by ([`Routing`]) and what a request must meet to be admitted ([`Admission`]). Each is
//! replaced whole: a request holds the version it read while a reload puts in the next.
//!
//! These are the settings operators retune in place: the policy and its weights, the
//! per-replica concurrency, the per-request bounds, the replicas' key (`--replica-api-key`,
//! held by [`super::forward::ForwardConfig`]) and the API keys (those of the `--config`
//! file: flags and the environment are the process's, fixed at its start; and those of
//! `--api-key-file`, [`super::key_file`], which also loads them when the file changes). The
//! others (listeners, tokenization, timeouts, the index's bounds) shape state built at start,
//! and take effect at the next one. A tunnel follows the admission's changes
//! ([`Live::subscribe`]): one whose key is revoked ends.

use std::sync::Arc;

use http::Method;
use kvroute_proto::api_key;
use tokio::sync::watch;

use super::error::ProxyError;
use super::lora;
use super::per_key::KeyId;
use super::route::RequestLimits;
use crate::config::Config;
use crate::policy::{self, Policy, PolicyKind};

/// The settings of [`Routing`]'s policy, by their names in a configuration file.
const POLICY_SETTINGS: [&str; 6] =
    ["balance-weight", "load-weight", "miss-weight", "offload-weight", "policy", "seed"];
/// Those of them the cache-aware cost weighs with.
const WEIGHTS: [&str; 4] = ["balance-weight", "load-weight", "miss-weight", "offload-weight"];
/// [`Routing`]'s other settings.
const ROUTING_SETTINGS: [&str; 3] = ["max-in-flight-per-replica", "no-rank-routing", "pd-min-prefill-tokens"];
/// [`Admission`]'s settings.
pub const ADMISSION_SETTINGS: [&str; 4] =
    ["api-key", "max-completion-tokens", "max-prompt-tokens", "max-in-flight-per-key"];
/// The key requests to the replicas carry ([`super::forward::ForwardConfig`]).
pub const REPLICA_KEY: &str = "replica-api-key";

/// Whether a reload applies `setting` (named as in a configuration file) at once.
pub fn is_live(setting: &str) -> bool {
    [&POLICY_SETTINGS[..], &ROUTING_SETTINGS, &ADMISSION_SETTINGS, &[REPLICA_KEY]].concat().contains(&setting)
}

/// Whether any of `changed` is one of `settings`.
fn any_of(changed: &[String], settings: &[&str]) -> bool {
    changed.iter().any(|key| settings.contains(&key.as_str()))
}

/// `from`'s live settings ([`is_live`]) copied into `into`, but the admission's
/// ([`carry_admission`]).
pub fn carry(into: &mut Config, from: &Config) {
    into.policy = from.policy;
    into.load_weight = from.load_weight;
    into.miss_weight = from.miss_weight;
    into.balance_weight = from.balance_weight;
    into.offload_weight = from.offload_weight;
    into.seed = from.seed;
    into.max_in_flight_per_replica = from.max_in_flight_per_replica;
    into.no_rank_routing = from.no_rank_routing;
    into.pd_min_prefill_tokens = from.pd_min_prefill_tokens;
    into.replica_api_key.clone_from(&from.replica_api_key);
}

/// `from`'s admission settings ([`ADMISSION_SETTINGS`]) copied into `into`.
pub fn carry_admission(into: &mut Config, from: &Config) {
    into.api_key.clone_from(&from.api_key);
    into.max_prompt_tokens = from.max_prompt_tokens;
    into.max_completion_tokens = from.max_completion_tokens;
    into.max_in_flight_per_key = from.max_in_flight_per_key;
}

/// A value replaced whole; each reader keeps the version it took. Clones share it.
#[derive(Debug)]
pub struct Live<T>(watch::Sender<Arc<T>>);

impl<T> Clone for Live<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> Live<T> {
    pub fn new(value: T) -> Self {
        Self(watch::Sender::new(Arc::new(value)))
    }

    /// The current version.
    pub fn get(&self) -> Arc<T> {
        Arc::clone(&self.0.borrow())
    }

    /// Replaces the value; readers holding the old version keep it until they let it go.
    pub fn set(&self, value: T) {
        self.0.send_replace(Arc::new(value));
    }

    /// Replaces the value with `f` of the current one, which no other change comes between.
    pub fn update(&self, f: impl FnOnce(&T) -> T) {
        self.0.send_modify(|value| *value = Arc::new(f(value)));
    }

    /// A receiver told of each version put in from now on.
    pub fn subscribe(&self) -> watch::Receiver<Arc<T>> {
        self.0.subscribe()
    }
}

/// What decisions route by.
pub struct Routing {
    pub policy: Arc<dyn Policy>,
    /// How a data-parallel replica's rank is named ([`crate::index::Ranks`]): by the
    /// cache-aware cost. `None` with the other policies, which leave it to the replica.
    pub ranks_by: Option<policy::CacheAware>,
    /// Requests in flight a replica may hold (`--max-in-flight-per-replica`).
    pub max_in_flight_per_replica: u32,
    /// The seed the random policies drew from: a reload keeps it unless one is given.
    pub seed: u64,
    /// `--pd-min-prefill-tokens` ([`super::disagg`]).
    pub pd_min_prefill_tokens: u64,
}

impl Routing {
    /// `config`'s routing, the random policies seeded with `seed`.
    pub fn new(config: &Config, seed: u64) -> Self {
        let policy = policy::build(config.policy, config.cache_aware_params(), seed).into();
        Self::with_policy(config, policy, seed)
    }

    fn with_policy(config: &Config, policy: Arc<dyn Policy>, seed: u64) -> Self {
        Self {
            policy,
            ranks_by: (config.policy == PolicyKind::CacheAware && !config.no_rank_routing)
                .then(|| policy::CacheAware::new(config.cache_aware_params())),
            max_in_flight_per_replica: config.max_in_flight_per_replica,
            seed,
            pd_min_prefill_tokens: config.pd_min_prefill_tokens,
        }
    }

    /// The routing of `config`, reloaded over this one with the settings `changed`; `None`
    /// if none of them is the routing's. The seed is this one's unless `config` gives one.
    /// The policy is made anew (its turn, or its random stream, starts over) only when it is
    /// another, or what it works with changed: the cache-aware cost's weights, the random
    /// policies' seed; else this one goes on.
    pub fn reloaded(&self, config: &Config, changed: &[String]) -> Option<Self> {
        if !any_of(changed, &POLICY_SETTINGS) && !any_of(changed, &ROUTING_SETTINGS) {
            return None;
        }
        let seed = config.seed.unwrap_or(self.seed);
        let anew = match config.policy {
            kind if kind != self.policy.kind() => true,
            PolicyKind::CacheAware => any_of(changed, &WEIGHTS),
            PolicyKind::Random | PolicyKind::PowerOfTwo => seed != self.seed,
            PolicyKind::RoundRobin | PolicyKind::LeastLoaded => false,
        };
        Some(match anew {
            true => Self::new(config, seed),
            false => Self::with_policy(config, Arc::clone(&self.policy), seed),
        })
    }
}

impl std::fmt::Debug for Routing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routing")
            .field("policy", &self.policy.kind())
            .field("ranks_by", &self.ranks_by.is_some())
            .field("max_in_flight_per_replica", &self.max_in_flight_per_replica)
            .field("pd_min_prefill_tokens", &self.pd_min_prefill_tokens)
            .finish_non_exhaustive()
    }
}

/// What a request must meet to be admitted.
#[derive(Clone)]
pub struct Admission {
    /// Prompt and completion bounds of routed requests.
    pub limits: RequestLimits,
    /// The keys a request may carry: `--api-key`'s, then `--api-key-file`'s (none: every
    /// request may pass).
    api_keys: Vec<String>,
    /// How many of `api_keys` are `--api-key`'s.
    given: usize,
    /// `--max-in-flight-per-key` (0: none).
    pub max_in_flight_per_key: u32,
}

impl Admission {
    /// `config`'s bounds and `--api-key`'s keys (without `--api-key-file`'s:
    /// [`Admission::with_file_keys`]).
    pub fn new(config: &Config) -> Self {
        let api_keys: Vec<String> = config.api_key.iter().map(|key| key.expose().to_owned()).collect();
        let max_in_flight_per_key = config.max_in_flight_per_key;
        Self { limits: config.request_limits(), given: api_keys.len(), api_keys, max_in_flight_per_key }
    }

    /// [`Admission::new`] of `config` if one of its settings is among `changed`.
    pub fn reloaded(config: &Config, changed: &[String]) -> Option<Self> {
        any_of(changed, &ADMISSION_SETTINGS).then(|| Self::new(config))
    }

    /// Whether every request may pass: there is no key to check.
    pub fn is_open(&self) -> bool {
        self.api_keys.is_empty()
    }

    /// This admission with `keys` in place of the key file's it held.
    pub fn with_file_keys(&self, keys: &[String]) -> Self {
        let api_keys = [&self.api_keys[..self.given], keys].concat();
        Self { api_keys, ..self.clone() }
    }

    /// Whether a request of `method` to `path` with `authorization` (the header's value) may
    /// pass: with keys, one to a [`guarded`] path must carry one of them.
    pub fn allows(&self, method: &Method, path: &str, authorization: Option<&[u8]>) -> bool {
        self.key_of(method, path, authorization).is_ok()
    }

    /// The key a request of `method` to `path` with `authorization` passes with, when keys'
    /// requests are counted (`--max-in-flight-per-key`): `Ok(None)` when it needs none (no
    /// keys, or a path they do not guard) or none is counted, `Err` when it lacks one.
    pub fn key_of(
        &self,
        method: &Method,
        path: &str,
        authorization: Option<&[u8]>,
    ) -> Result<Option<KeyId>, ProxyError> {
        if self.is_open() || !guarded(method, path) {
            return Ok(None);
        }
        match api_key::matching(authorization, &self.api_keys) {
            Some(i) => Ok((self.max_in_flight_per_key > 0).then(|| KeyId::of(&self.api_keys[i]))),
            None => Err(ProxyError::Unauthorized),
        }
    }
}

/// Whether a request of `method` to `path` is one the router's keys guard: one to a path under
/// `/v1` ([`api_key::needs_key`]) or to the router's own LoRA paths (SGLang's spellings outside
/// `/v1` too). The engines' own paths outside `/v1` are theirs to guard.
pub fn guarded(method: &Method, path: &str) -> bool {
    api_key::needs_key(method, path) || lora::route(path).is_some()
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The keys are secrets: how many there are, only.
        f.debug_struct("Admission")
            .field("limits", &self.limits)
            .field("api_keys", &self.api_keys.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changed(keys: &[&str]) -> Vec<String> {
        keys.iter().map(|key| (*key).to_owned()).collect()
    }

    /// A policy whose own settings did not change is kept (its turn goes on); one whose did is
    /// made anew; the seed stays unless given; admission alone leaves the routing be.
    #[test]
    fn a_reload_makes_the_policy_anew_only_when_its_settings_change() {
        let config = Config { seed: Some(7), ..Config::loopback(Vec::new()) };
        let running = Routing::new(&config, 7);
        let wider = Config { max_in_flight_per_replica: 3, ..config.clone() };
        let kept = running.reloaded(&wider, &changed(&["max-in-flight-per-replica"])).unwrap();
        assert!(Arc::ptr_eq(&kept.policy, &running.policy));
        assert_eq!((kept.max_in_flight_per_replica, kept.seed), (3, 7));
        let weighed = Config { miss_weight: 2.0, seed: None, ..config.clone() };
        let anew = running.reloaded(&weighed, &changed(&["miss-weight", "seed"])).unwrap();
        assert!(!Arc::ptr_eq(&anew.policy, &running.policy), "the cost weighs otherwise");
        assert_eq!(anew.seed, 7, "a seed no longer given stays the one drawn");
        let unseeded = Config { seed: None, ..config.clone() };
        let same = running.reloaded(&unseeded, &changed(&["seed"])).unwrap();
        assert!(Arc::ptr_eq(&same.policy, &running.policy), "the same seed: the same policy");
        // The cache-aware weights are nothing to round-robin, and a seed nothing to it either;
        // a seed is the random policy's stream.
        let turns = Routing::new(&Config { policy: PolicyKind::RoundRobin, ..config.clone() }, 7);
        let reweighed =
            Config { policy: PolicyKind::RoundRobin, miss_weight: 2.0, seed: Some(8), ..config.clone() };
        let kept = turns.reloaded(&reweighed, &changed(&["miss-weight", "seed"])).unwrap();
        assert!(Arc::ptr_eq(&kept.policy, &turns.policy), "round-robin keeps its turn");
        let random = Routing::new(&Config { policy: PolicyKind::Random, ..config.clone() }, 7);
        let reseeded = Config { policy: PolicyKind::Random, seed: Some(8), ..config.clone() };
        let drawn = random.reloaded(&reseeded, &changed(&["seed"])).unwrap();
        assert!(!Arc::ptr_eq(&drawn.policy, &random.policy), "a new seed, a new stream");
        let round_robin = Config { policy: PolicyKind::RoundRobin, ..config.clone() };
        let switched = running.reloaded(&round_robin, &changed(&["policy"])).unwrap();
        assert_eq!((switched.policy.kind(), switched.ranks_by.is_some()), (PolicyKind::RoundRobin, false));
        assert!(running.reloaded(&config, &changed(&["api-key", "max-prompt-tokens"])).is_none());
        assert!(Admission::reloaded(&config, &changed(&["policy"])).is_none());
        assert!(Admission::reloaded(&config, &changed(&["api-key"])).is_some());
    }

    /// Every live setting is a setting of the configuration, and is carried by [`carry`].
    #[test]
    fn live_settings_are_configuration_keys_and_carried() {
        let running = Config::loopback(Vec::new());
        let new = Config {
            policy: PolicyKind::Random,
            load_weight: 9.0,
            miss_weight: 9.0,
            balance_weight: 9.0,
            offload_weight: 0.5,
            seed: Some(1),
            max_in_flight_per_replica: 9,
            no_rank_routing: true,
            pd_min_prefill_tokens: 9,
            api_key: vec!["sk".into()],
            max_prompt_tokens: 9,
            max_completion_tokens: 9,
            max_in_flight_per_key: 9,
            replica_api_key: Some(crate::config::Secret::new("sk-fleet")),
            ..running.clone()
        };
        let keys = |config: &Config| match serde_json::to_value(config) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => unreachable!("a configuration is a map"),
        };
        let (before, after) = (keys(&running), keys(&new));
        let live: Vec<&String> = after.keys().filter(|key| is_live(key)).collect();
        assert_eq!(live.len(), POLICY_SETTINGS.len() + ROUTING_SETTINGS.len() + ADMISSION_SETTINGS.len() + 1);
        assert!(live.iter().all(|key| before.get(*key) != after.get(*key)), "each was changed above");
        let mut carried = running.clone();
        carry(&mut carried, &new);
        assert_ne!(carried, new, "the admission's settings are carried apart");
        carry_admission(&mut carried, &new);
        assert_eq!(carried, new, "every live setting carried, nothing else");
    }
}
