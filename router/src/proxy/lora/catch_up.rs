//! Adapters loaded through the router reach replicas that lack them: one that joined the
//! fleet later, or restarted and lost what was loaded at run time, or was down when the
//! adapter was loaded. The router keeps each adapter with the request that loaded it
//! ([`Registry`]); after each active health check of a replica ([`crate::proxy::health`]) it
//! reads what the replica lists in `/v1/models` (the check's own list, when the replica gave
//! it to the check's credentials: none, or `--replica-api-key`) and sends the load request again for what is
//! missing, in a task of its own (a load can take longer than a health check may). Until a
//! replica is known to have an adapter, that adapter's requests go to the replicas that have
//! it ([`crate::proxy::upstream::Ineligible::NoAdapter`]).
//!
//! A catch-up and a change through the router never overlap: a change waits for running
//! catch-ups, and a catch-up does not start while a change runs (it would load an adapter
//! being unloaded, or the one a new load replaces).
//!
//! SGLang replicas are not asked what they list: an adapter goes to one when the router
//! first checks it, and is taken as there until the replica is seen to have restarted: back
//! from failed health checks, or with a new process start time on its metrics page (vLLM's
//! says one, SGLang's not). A restart quicker than the checks that would fail is not noticed.
//!
//! What is kept of the load request: its body, and of its headers only `Authorization`
//! (replicas started with `--api-key`; marked sensitive, never printed) and `Content-Type`.
//! With `--replica-api-key` the router's own key goes in its place ([`crate::proxy::control`]),
//! so that a catch-up does not depend on a client key that may since have been rotated.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Method, StatusCode};
use kvroute_proto::ReplicaId;
use serde_json::value::RawValue;

use super::Change;
use crate::fleet::{Fleet, Member};
use crate::proxy::body::full;
use crate::proxy::control::Client;
use crate::replicas::EngineKind;

/// A LoRA adapter loaded through the router: its name, and what is kept of the load request
/// (see the module docs), sent again to replicas that lack it.
#[derive(Clone)]
pub struct Adapter {
    pub name: String,
    body: Bytes,
    headers: HeaderMap,
}

impl Adapter {
    /// The load request's body, as repeated to a replica that lacks the adapter.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The adapter `name`, loaded with `body` and the request's `headers`.
    pub fn new(name: String, body: Bytes, headers: &HeaderMap) -> Self {
        let mut kept = HeaderMap::new();
        if let Some(authorization) = headers.get(header::AUTHORIZATION) {
            let mut authorization = authorization.clone();
            authorization.set_sensitive(true);
            kept.insert(header::AUTHORIZATION, authorization);
        }
        if let Some(content_type) = headers.get(header::CONTENT_TYPE) {
            kept.insert(header::CONTENT_TYPE, content_type.clone());
        }
        Self { name, body, headers: kept }
    }
}

impl fmt::Debug for Adapter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Adapter").field("name", &self.name).finish_non_exhaustive()
    }
}

/// The adapters loaded through the router that every replica should have.
#[derive(Debug, Default)]
pub struct Registry {
    adapters: RwLock<Vec<Adapter>>,
    /// Whether there is any, so a request to the base model takes no lock.
    any: AtomicBool,
    /// Changes through the router take it whole, one at a time; catch-ups share it.
    turn: tokio::sync::RwLock<()>,
    /// Replicas whose catch-up is running.
    busy: Mutex<HashSet<ReplicaId>>,
}

impl Registry {
    /// Keeps `adapter` (in place of one of its name).
    pub fn insert(&self, adapter: Adapter) {
        let mut adapters = self.adapters.write().unwrap_or_else(PoisonError::into_inner);
        adapters.retain(|a| a.name != adapter.name);
        adapters.push(adapter);
        self.any.store(true, Ordering::Relaxed);
    }

    pub fn remove(&self, name: &str) {
        let mut adapters = self.adapters.write().unwrap_or_else(PoisonError::into_inner);
        adapters.retain(|a| a.name != name);
        self.any.store(!adapters.is_empty(), Ordering::Relaxed);
    }

    /// Whether `model` names an adapter loaded through the router.
    pub fn contains(&self, model: &str) -> bool {
        self.any.load(Ordering::Relaxed)
            && self.adapters.read().unwrap_or_else(PoisonError::into_inner).iter().any(|a| a.name == model)
    }

    pub fn all(&self) -> Vec<Adapter> {
        self.adapters.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// A turn between changes, if none is running or waiting: no change starts while it is
    /// held.
    pub fn between_changes(&self) -> Option<tokio::sync::RwLockReadGuard<'_, ()>> {
        self.turn.try_read().ok()
    }

    /// The turn of a change through the router: once running catch-ups are done, and none
    /// starts until it is dropped.
    pub async fn change(&self) -> tokio::sync::RwLockWriteGuard<'_, ()> {
        self.turn.write().await
    }
}

/// How long a catch-up waits for a replica's list, and for a load.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub list: Duration,
    pub load: Duration,
}

/// Starts [`catch_up`] for `member` in a task of its own, unless there is nothing to catch up
/// or its last one is still running.
///
/// `listed`: the models the replica listed to the health check that calls this, if it
/// answered the check's credentials (then it is not asked again).
pub fn spawn(
    fleet: &Fleet,
    member: Member,
    client: &Client,
    timeouts: Timeouts,
    listed: Option<HashSet<String>>,
) {
    let registry = fleet.adapters();
    if !registry.any.load(Ordering::Relaxed) {
        return;
    }
    let id = member.replica.id;
    if !registry.busy.lock().unwrap_or_else(PoisonError::into_inner).insert(id) {
        return;
    }
    let (fleet, client) = (fleet.clone(), client.clone());
    tokio::spawn(async move {
        let registry = fleet.adapters();
        // A change is running or waiting: it goes first, this replica is seen to next time.
        if let Ok(_turn) = registry.turn.try_read() {
            catch_up(&member, &client, registry, timeouts, listed).await;
        }
        registry.busy.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
    });
}

/// Gives `member` the adapters of `registry` it lacks (see the module docs), and marks those
/// it has.
pub async fn catch_up(
    member: &Member,
    client: &Client,
    registry: &Registry,
    timeouts: Timeouts,
    known: Option<HashSet<String>>,
) {
    let adapters = registry.all();
    let Some(latest) = adapters.last() else { return };
    let spec = &member.replica.spec;
    let listed = match spec.engine {
        EngineKind::Sglang => None,
        _ if known.is_some() => known,
        // The latest load's credentials, for replicas started with `--api-key`.
        _ => match listed_models(client, &spec.http_url, &latest.headers, timeouts.list).await {
            Listed::Models(listed) => Some(listed),
            // A replica that refuses the credentials cannot be shown to have any, and would
            // refuse the adapter's requests too.
            Listed::Refused => Some(HashSet::new()),
            // Not this time (it will be asked again at the next check).
            Listed::Unknown => return,
        },
    };
    let missing: Vec<&Adapter> = adapters
        .iter()
        .filter(|adapter| {
            let has = match &listed {
                Some(listed) => listed.contains(&adapter.name),
                None => member.upstream.has_adapter(&adapter.name),
            };
            member.upstream.mark_adapter(&adapter.name, has);
            !has
        })
        .collect();
    let loads = missing.into_iter().map(|adapter| async move {
        let url = format!("{}{}", spec.http_url, Change::Load.path(spec.engine));
        let load = send(client, Method::POST, &url, &adapter.headers, adapter.body.clone(), timeouts.load);
        match load.await {
            Some((status, _)) if status.is_success() => {
                tracing::info!(replica = %spec.name, lora_name = adapter.name, "LoRA adapter loaded on a replica that lacked it");
            }
            Some((status, body)) if Change::Load.there_already(status, &body) => {}
            answer => {
                let answer = answer.map(|(s, b)| format!("{s} {}", String::from_utf8_lossy(&b).trim()));
                tracing::warn!(replica = %spec.name, lora_name = adapter.name, ?answer, "cannot load the LoRA adapter on a replica that lacks it");
                return;
            }
        }
        member.upstream.mark_adapter(&adapter.name, true);
    });
    futures::future::join_all(loads).await;
}

/// What a replica's `GET /v1/models` said.
enum Listed {
    /// The model ids it lists.
    Models(HashSet<String>),
    /// It refused the credentials (401 or 403).
    Refused,
    /// No answer, or one that tells nothing (a 5xx, say).
    Unknown,
}

async fn listed_models(client: &Client, base: &str, credentials: &HeaderMap, timeout: Duration) -> Listed {
    let mut headers = HeaderMap::new();
    if let Some(authorization) = credentials.get(header::AUTHORIZATION) {
        headers.insert(header::AUTHORIZATION, authorization.clone());
    }
    let url = format!("{base}/v1/models");
    let Some((status, body)) = send(client, Method::GET, &url, &headers, Bytes::new(), timeout).await else {
        return Listed::Unknown;
    };
    match (status, model_cards(&body)) {
        (StatusCode::OK, Some(cards)) => Listed::Models(cards.into_iter().map(|card| card.id).collect()),
        (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN, _) => Listed::Refused,
        _ => Listed::Unknown,
    }
}

/// One model of a `GET /v1/models` answer; an adapter has the model it adapts as `parent`.
pub struct ModelCard<'a> {
    pub id: String,
    pub parent: Option<String>,
    /// The card as listed, read further only for the fields the router keeps ([`Self::fields`]).
    raw: &'a RawValue,
}

/// The most of a card's other fields the router keeps, in bytes as listed: a replica's card is
/// copied into every answer to `GET /v1/models`, and the listing may be up to
/// [`REPLICA_ANSWER_BYTES`](super::super::body::REPLICA_ANSWER_BYTES) long.
pub const CARD_BYTES: usize = 16 << 10;

impl ModelCard<'_> {
    /// Its other fields (vLLM's `root`, `owned_by`, `max_model_len`, `permission`, ...), the
    /// shortest first, as many as fit in [`CARD_BYTES`] as listed: a long one is left out, not
    /// the short ones clients read (`max_model_len`).
    pub fn fields(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut kept = serde_json::Map::new();
        let Ok(fields) = serde_json::from_str::<BTreeMap<String, &RawValue>>(self.raw.get()) else {
            return kept;
        };
        // `"name":value,`
        let size = |(name, value): &(String, &RawValue)| name.len() + value.get().len() + 4;
        let mut fields: Vec<_> =
            fields.into_iter().filter(|(name, _)| name != "id" && name != "parent").collect();
        fields.sort_by_key(size);
        let mut left = CARD_BYTES;
        for field in fields {
            let size = size(&field);
            let (name, value) = field;
            if size > left {
                break;
            }
            if let Ok(value) = serde_json::from_str(value.get()) {
                left -= size;
                kept.insert(name, value);
            }
        }
        kept
    }
}

/// The models of a `GET /v1/models` answer (OpenAI's `{"data": [...]}`), each read no further
/// than its id and parent.
pub fn model_cards(body: &[u8]) -> Option<Vec<ModelCard<'_>>> {
    #[derive(serde::Deserialize)]
    struct Models<'a> {
        #[serde(borrow)]
        data: Vec<&'a RawValue>,
    }
    #[derive(serde::Deserialize)]
    struct Names {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    let models: Models = serde_json::from_slice(body).ok()?;
    models
        .data
        .into_iter()
        .map(|raw| {
            let Names { id, parent } = serde_json::from_str(raw.get()).ok()?;
            Some(ModelCard { id, parent, raw })
        })
        .collect()
}

/// Sends a request and reads its whole answer within `timeout`.
async fn send(
    client: &Client,
    method: Method,
    url: &str,
    headers: &HeaderMap,
    body: Bytes,
    timeout: Duration,
) -> Option<(StatusCode, Bytes)> {
    let mut request = http::Request::builder().method(method).uri(url).body(full(body)).ok()?;
    request.headers_mut().extend(headers.iter().map(|(k, v)| (k.clone(), v.clone())));
    let exchange = async {
        let response = client.request(request).await.ok()?;
        let status = response.status();
        let body =
            super::super::body::read_at_most(response.into_body(), super::super::body::REPLICA_ANSWER_BYTES);
        Some((status, body.await.ok()?))
    };
    tokio::time::timeout(timeout, exchange).await.ok()?
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A card's fields are kept up to [`CARD_BYTES`]: a replica listing a huge field had it
    /// kept, and copied into every answer to the fleet's `GET /v1/models`.
    #[test]
    fn a_card_keeps_its_fields_up_to_a_bound() {
        let junk = "x".repeat(1 << 20);
        // Not so long as to be left out alone, and listed (by name) before `max_model_len`.
        let about = "y".repeat(CARD_BYTES - 20);
        let body = serde_json::json!({"object": "list", "data": [
            {"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 4096, "junk": junk, "about": about,
             "permission": [{"id": "modelperm-1", "allow_sampling": true}]},
            {"id": "a", "parent": "m", "root": "/adapters/a"},
        ]})
        .to_string();
        let cards = model_cards(body.as_bytes()).unwrap();
        let names: Vec<_> = cards.iter().map(|c| (c.id.as_str(), c.parent.as_deref())).collect();
        assert_eq!(names, [("m", None), ("a", Some("m"))]);
        let fields = cards[0].fields();
        let mut kept: Vec<_> = fields.keys().map(String::as_str).collect();
        kept.sort_unstable();
        assert_eq!(kept, ["max_model_len", "object", "owned_by", "permission"], "the long ones left out");
        assert_eq!(fields["max_model_len"], 4096);
        assert!(serde_json::to_string(&fields).unwrap().len() <= CARD_BYTES);
        assert_eq!(cards[1].fields().keys().collect::<Vec<_>>(), ["root"]);
        // Not a listing: no cards.
        assert!(model_cards(br#"{"data": [{"id": 1}]}"#).is_none());
        assert!(model_cards(br#"{"data": [7]}"#).is_none());
    }
}
