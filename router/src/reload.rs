//! Reloading the configuration without a restart: on `SIGHUP` the router reads it again, as
//! at its start (flags, environment, the `--config` file), makes the fleet hold the replicas
//! it lists now, and routes by its live settings ([`Reloader::apply`]).
//!
//! - A replica the list no longer names is removed (for good: its drain is forgotten, as an
//!   operator's `RemoveReplica` does); one it names anew is added; one whose entry changed is
//!   replaced (at the same HTTP address its load, health and requests in flight go on; its
//!   index starts again from its events). A replica whose entry is unchanged is left alone,
//!   index and all.
//! - Only the replicas the configuration listed are the reload's to change: those discovery
//!   or the admin service added stay (a listed name they hold is taken over by the list).
//! - A configuration that does not read or validate changes nothing; its errors are logged.
//!   A replica the fleet refuses (another's HTTP address or event stream) is logged and left
//!   out; it is tried once more after the others, as an address the list frees later may be
//!   the one it wants.
//! - The routing policy and its weights, the per-replica concurrency, the per-request bounds,
//!   the API keys and the replicas' key ([`crate::proxy::live`]) change at once: decisions made
//!   from then on route by the new ones, a request already admitted keeps the bounds it was
//!   admitted by, and requests waiting for a replica's room look again when its limit rose. The
//!   random policies keep their seed unless one is given; a policy whose own settings did not
//!   change keeps its state (its turn, its random stream).
//! - With TLS on the proxy's listener (`--tls-cert`, `--tls-key`), the certificate, key and
//!   client authorities (`--tls-client-ca`) are read again, from the paths the configuration
//!   names now: a certificate rotated in place is served to the connections opened from then
//!   on. (TLS itself is turned on or off at a start; client certificates are asked for or not
//!   from a reload on.)
//! - The replicas' TLS files (`--replica-ca-cert`, `--replica-client-cert`,
//!   `--replica-client-key`) are read again, from the paths the configuration names now:
//!   connections to replicas opened from then on use them ([`crate::proxy::connect`]).
//! - `--replica-api-key-file` is read again, from the path the configuration names now: its
//!   key is sent from then on (one that cannot be loaded keeps the key in use); with none
//!   named, `--replica-api-key`'s is, or none ([`crate::proxy::replica_key`]).
//! - `--api-key-file` is read again, from the path the configuration names now (none: its keys
//!   are dropped); one that cannot be loaded keeps the keys in use
//!   ([`crate::proxy::key_file`]), and a first one the whole admission in force: `--api-key`
//!   and the limits it changes too wait for a reload that reads it.
//! - Other settings take effect at the next start: a reload names those that changed. The
//!   replicas keep the running router's model and block size. The tokenizer's files are read
//!   at a start only, so a reload warns of any it could not read: the next start would fail.

use std::collections::BTreeMap;

use crate::config::Config;
use crate::discovery::ReplicaSink;
use crate::fleet::Fleet;
use crate::proxy::ProxyState;
use crate::proxy::live::{self, Admission};
use crate::replicas::ReplicaSpec;

/// The configuration's replicas as last applied, and the settings the router runs with.
#[derive(Debug)]
pub struct Reloader {
    applied: BTreeMap<String, ReplicaSpec>,
    running: Config,
}

/// What a reload changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reloaded {
    pub added: Vec<String>,
    pub replaced: Vec<String>,
    pub removed: Vec<String>,
    /// Replicas the fleet refused, each with why.
    pub refused: Vec<(String, String)>,
    /// Settings besides the replicas that changed and were applied ([`live::is_live`]).
    pub applied: Vec<String>,
    /// Settings besides the replicas that differ from the running router's (not applied).
    pub not_applied: Vec<String>,
    /// Whether the proxy listener's certificate, key and client CA were read again, or why not;
    /// `None` when it serves no TLS, or the configuration names none now.
    pub tls: Option<Result<(), String>>,
    /// How many keys `--api-key-file` holds now, or why the keys in use stay; `None` when the
    /// configuration names no key file.
    pub api_key_file: Option<Result<usize, String>>,
    /// Whether the replicas' TLS files were read again, or why not; `None` when neither the
    /// running configuration nor this one names any.
    pub replica_tls: Option<Result<(), String>>,
    /// Whether `--replica-api-key-file` was read again (its key sent from then on), or why the
    /// key in use stays; `None` when the configuration names no such file.
    pub replica_api_key_file: Option<Result<(), String>>,
    /// What would stop the next start, which reads files a reload does not: the tokenizer's
    /// ([`Config::tokenizer_problems`]), a path changed to one missing, or a file removed.
    pub next_start_fails: Vec<String>,
}

/// The settings of the files a reload reads again, each group applied (or not) as one.
const TLS_FILES: &[&str] = &["tls-cert", "tls-key", "tls-client-ca"];
const REPLICA_TLS_FILES: &[&str] = &["replica-ca-cert", "replica-client-cert", "replica-client-key"];
const KEY_FILE: &[&str] = &["api-key-file"];
const REPLICA_KEY_FILE: &[&str] = &["replica-api-key-file"];

impl Reloaded {
    /// The settings not applied that wait for the next start: not those of files that could
    /// not be read again, whose error says so (and which a reload applies once they can be).
    pub fn at_next_start(&self) -> Vec<&str> {
        let failed = |loaded: Option<bool>, settings: &'static [&'static str]| {
            if loaded == Some(false) { settings } else { &[] }
        };
        let failed = [
            failed(self.tls.as_ref().map(Result::is_ok), TLS_FILES),
            failed(self.replica_tls.as_ref().map(Result::is_ok), REPLICA_TLS_FILES),
            failed(self.api_key_file.as_ref().map(Result::is_ok), KEY_FILE),
            failed(self.api_key_file.as_ref().map(Result::is_ok), &live::ADMISSION_SETTINGS),
            failed(self.replica_api_key_file.as_ref().map(Result::is_ok), REPLICA_KEY_FILE),
        ]
        .concat();
        (self.not_applied.iter().map(String::as_str)).filter(|s| !failed.contains(s)).collect()
    }

    /// `settings`, among those applied, moved back to the not applied.
    fn not_applied_after_all(&mut self, settings: &[&str]) {
        moved(settings, &mut self.applied, &mut self.not_applied);
    }

    /// `settings`, among those not applied, moved to the applied.
    fn now_applied(&mut self, settings: &[&str]) {
        moved(settings, &mut self.not_applied, &mut self.applied);
    }
}

/// `settings`, among those in `from`, moved to `to` (kept sorted).
fn moved(settings: &[&str], from: &mut Vec<String>, to: &mut Vec<String>) {
    let (now, others) =
        std::mem::take(from).into_iter().partition(|setting| settings.contains(&setting.as_str()));
    *from = others;
    to.extend::<Vec<String>>(now);
    to.sort_unstable();
}

impl Reloader {
    /// For a router started with `config`, whose replicas the fleet holds.
    pub fn new(config: &Config) -> Self {
        let running = config.clone();
        Self { applied: specs(&running, &running), running }
    }

    /// Makes the router of `state` hold the replicas of `config` in place of those of the last
    /// one applied, and route and admit requests by its live settings ([`live::is_live`]).
    pub async fn apply(&mut self, state: &ProxyState, config: &Config) -> Reloaded {
        let fleet = state.fleet();
        let (applied, not_applied) =
            changed_settings(&self.running, config).into_iter().partition(|key| live::is_live(key));
        let next_start_fails = config.tokenizer_problems();
        let mut reloaded = Reloaded { applied, not_applied, next_start_fails, ..Reloaded::default() };
        self.apply_live(state, config, &reloaded.applied);
        self.reload_admission(state, config, &mut reloaded);
        self.reload_tls(state, config, &mut reloaded);
        self.reload_replica_tls(state, config, &mut reloaded);
        self.reload_replica_key(state, config, &mut reloaded);
        let desired = specs(&self.running, config);
        let gone: Vec<String> =
            self.applied.keys().filter(|name| !desired.contains_key(*name)).cloned().collect();
        for name in gone {
            self.applied.remove(&name);
            if fleet.remove_for_good(&name).await.freed.is_some() {
                reloaded.removed.push(name);
            }
        }
        let mut refused = Vec::new();
        for (name, spec) in desired {
            if ReplicaSink::holds(fleet, &name, &spec) {
                self.applied.insert(name, spec);
                continue;
            }
            if self.upsert(fleet, spec.clone(), &mut reloaded).await.is_err() {
                refused.push(spec);
            }
        }
        for spec in refused {
            let name = spec.name.clone();
            if let Err(why) = self.upsert(fleet, spec, &mut reloaded).await {
                tracing::warn!(replica = %name, error = %why, "reload: replica refused");
                reloaded.refused.push((name, why));
            }
        }
        reloaded
    }

    /// Puts `config`'s routing in place of the running one, where any of its settings
    /// (`changed`) did, and carries the live settings (the admission's are put in by
    /// [`Reloader::reload_admission`], the replicas' key by [`Reloader::reload_replica_key`]).
    fn apply_live(&mut self, state: &ProxyState, config: &Config, changed: &[String]) {
        let running = state.decider.routing.get();
        if let Some(routing) = running.reloaded(config, changed) {
            let raised = routing.max_in_flight_per_replica > running.max_in_flight_per_replica;
            state.decider.routing.set(routing);
            if raised {
                // Requests waiting for a replica's room may have it now.
                state.fleet().waiters().wake_all();
            }
        }
        live::carry(&mut self.running, config);
    }

    /// Reads the proxy listener's certificate, key and client CA (if any) again, where it
    /// serves TLS and `config` names them: from then on their paths count as applied.
    fn reload_tls(&mut self, state: &ProxyState, config: &Config, reloaded: &mut Reloaded) {
        let (Some(tls), Ok(Some(files))) = (&state.tls, config.tls_files()) else {
            return;
        };
        let loaded = tls.load(&files);
        if loaded.is_ok() && self.running.tls_client_ca.is_some() && files.client_ca.is_none() {
            tracing::warn!(
                "reload: --tls-client-ca is no longer named: clients without a certificate are admitted"
            );
        }
        if loaded.is_ok() {
            reloaded.now_applied(TLS_FILES);
            self.running.tls_cert = config.tls_cert.clone();
            self.running.tls_key = config.tls_key.clone();
            self.running.tls_client_ca = config.tls_client_ca.clone();
        }
        reloaded.tls = Some(loaded);
    }

    /// Reads the replicas' TLS files again, from the paths `config` names now (none: the
    /// system's authorities, no client certificate): connections to replicas opened from then
    /// on use them. From then on their paths count as applied.
    fn reload_replica_tls(&mut self, state: &ProxyState, config: &Config, reloaded: &mut Reloaded) {
        let (Ok(files), Ok(running)) = (config.replica_tls_files(), self.running.replica_tls_files()) else {
            return;
        };
        if files.is_empty() && running.is_empty() {
            return;
        }
        let loaded = state.replica_tls.load(&files);
        if loaded.is_ok() {
            reloaded.now_applied(REPLICA_TLS_FILES);
            self.running.replica_ca_cert = config.replica_ca_cert.clone();
            self.running.replica_client_cert = config.replica_client_cert.clone();
            self.running.replica_client_key = config.replica_client_key.clone();
        }
        reloaded.replica_tls = Some(loaded);
    }

    /// Puts `config`'s replicas' key in place: that of the `--replica-api-key-file` it names,
    /// read again (if it cannot be loaded, the key in use stays), else `--replica-api-key`'s
    /// (or none). From then on the file's path counts as applied.
    fn reload_replica_key(&mut self, state: &ProxyState, config: &Config, reloaded: &mut Reloaded) {
        let path = config.replica_api_key_file.as_deref();
        let (flag, replicas) = (config.replica_authorization(), &state.forward.replica_authorization);
        let loaded = state.replica_key_file.apply(path, flag, replicas);
        if loaded.as_ref().is_none_or(Result::is_ok) {
            reloaded.now_applied(REPLICA_KEY_FILE);
            self.running.replica_api_key_file = config.replica_api_key_file.clone();
        }
        reloaded.replica_api_key_file = loaded;
    }

    /// Puts `config`'s admission in place of the running one where any of its settings (among
    /// those applied) did, with the keys of the `--api-key-file` it names (if any), read again:
    /// in one change. From then on the file's path counts as applied.
    fn reload_admission(&mut self, state: &ProxyState, config: &Config, reloaded: &mut Reloaded) {
        let path = config.api_key_file.as_deref();
        let admission = Admission::reloaded(config, &reloaded.applied);
        let had_file = state.key_file.is_loaded();
        let loaded = state.key_file.load(path, admission, &state.admission);
        if loaded.is_ok() {
            reloaded.now_applied(KEY_FILE);
            self.running.api_key_file = config.api_key_file.clone();
        }
        // A first key file that cannot be read leaves the admission in force whole: its new
        // settings wait, with the file, for a reload that can read it.
        if loaded.is_ok() || had_file {
            live::carry_admission(&mut self.running, config);
        } else {
            reloaded.not_applied_after_all(&live::ADMISSION_SETTINGS);
            let waiting: Vec<&str> = reloaded
                .not_applied
                .iter()
                .map(String::as_str)
                .filter(|s| live::ADMISSION_SETTINGS.contains(s))
                .collect();
            if !waiting.is_empty() {
                tracing::warn!(settings = ?waiting, "reload: these wait for --api-key-file, which cannot be read");
            }
        }
        reloaded.api_key_file = path.map(|_| loaded);
        crate::server::warn_if_replicas_open(state, config);
    }

    /// Adds or replaces `spec`, and records what it did.
    async fn upsert(
        &mut self,
        fleet: &Fleet,
        spec: ReplicaSpec,
        reloaded: &mut Reloaded,
    ) -> Result<(), String> {
        let name = spec.name.clone();
        let known = fleet.knows(&name);
        match fleet.upsert(spec.clone()).await {
            Ok(()) => {
                match known {
                    true => reloaded.replaced.push(name.clone()),
                    false => reloaded.added.push(name.clone()),
                }
                self.applied.insert(name, spec);
                Ok(())
            }
            Err(e) => {
                // (A replaced replica whose new entry is refused is gone: no longer the list's.)
                self.applied.remove(&name);
                Err(e.to_string())
            }
        }
    }
}

/// The replicas `config` lists, with the model and block size the router runs with.
fn specs(running: &Config, config: &Config) -> BTreeMap<String, ReplicaSpec> {
    (config.replicas.iter())
        .map(|r| (r.name.clone(), r.to_spec(&running.model, running.block_size)))
        .collect()
}

/// The settings of `new` besides the replicas that differ from `running`'s, by name.
fn changed_settings(running: &Config, new: &Config) -> Vec<String> {
    let settings = |config: &Config| match serde_json::to_value(config) {
        Ok(serde_json::Value::Object(mut settings)) => {
            settings.remove("replica");
            settings
        }
        _ => serde_json::Map::new(),
    };
    let (running, new) = (settings(running), settings(new));
    let mut changed: Vec<String> = (running.keys().chain(new.keys()))
        .filter(|key| running.get(*key) != new.get(*key))
        .cloned()
        .collect();
    changed.sort_unstable();
    changed.dedup();
    changed
}

/// Reloads the configuration at each `SIGHUP` (`hangups`, listened for since before the router
/// started: a `SIGHUP` meanwhile would have killed it) until `shutdown` fires (see the module
/// docs).
#[cfg(unix)]
pub async fn on_hangup(
    state: std::sync::Arc<ProxyState>,
    mut reloader: Reloader,
    hangups: std::io::Result<tokio::signal::unix::Signal>,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let mut hangups = match hangups {
        Ok(hangups) => hangups,
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP: the configuration is not reloaded");
            return;
        }
    };
    loop {
        tokio::select! {
            Some(()) = hangups.recv() => {}
            () = shutdown.cancelled() => return,
        }
        let config = match kvroute_proto::cli::parse::<Config>() {
            Ok(config) => config,
            Err(refused) => {
                tracing::error!(error = %refused.error, "reload: the configuration cannot be read; nothing changed");
                continue;
            }
        };
        if let Err(errors) = config.validate_for_reload() {
            tracing::error!(errors = %errors.join("; "), "reload: the configuration is invalid; nothing changed");
            continue;
        }
        let reloaded = reloader.apply(&state, &config).await;
        tracing::info!(
            added = ?reloaded.added, replaced = ?reloaded.replaced, removed = ?reloaded.removed,
            refused = reloaded.refused.len(), settings = %reloaded.applied.join(", "), "reload: applied"
        );
        match &reloaded.tls {
            Some(Ok(())) => tracing::info!("reload: the TLS files read again"),
            Some(Err(why)) => tracing::error!(error = %why, "reload: the TLS certificate in use stays"),
            None => {}
        }
        match &reloaded.replica_tls {
            Some(Ok(())) => tracing::info!("reload: the replicas' TLS files read again"),
            Some(Err(why)) => tracing::error!(error = %why, "reload: the replicas' TLS settings in use stay"),
            None => {}
        }
        match &reloaded.replica_api_key_file {
            Some(Ok(())) => tracing::info!("reload: --replica-api-key-file read again"),
            Some(Err(why)) => {
                tracing::error!(error = %why, "reload: --replica-api-key-file cannot be loaded; the key in use stays")
            }
            None => {}
        }
        match &reloaded.api_key_file {
            Some(Ok(keys)) => tracing::info!(keys, "reload: --api-key-file read again"),
            Some(Err(why)) => {
                tracing::error!(error = %why, "reload: --api-key-file cannot be loaded; the keys in use stay")
            }
            None => {}
        }
        let at_next_start = reloaded.at_next_start();
        if !at_next_start.is_empty() {
            tracing::warn!(
                settings = %at_next_start.join(", "),
                "reload: settings other than the replicas take effect at the next start"
            );
        }
        if !reloaded.next_start_fails.is_empty() {
            tracing::warn!(
                errors = %reloaded.next_start_fails.join("; "),
                "reload: the next start would fail on these files"
            );
        }
    }
}
