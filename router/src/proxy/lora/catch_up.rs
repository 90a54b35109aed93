//! Adapters loaded through the router reach replicas that lack them: one that joined the
//! fleet later, or restarted and lost what was loaded at run time. The router keeps each
//! adapter with the request that loaded it ([`Registry`]); at each active health check of a
//! replica ([`crate::proxy::health`]) it reads what the replica lists in `/v1/models` and
//! sends the load request again for what is missing. Until a replica is known to have an
//! adapter, that adapter's requests go to the replicas that have it
//! ([`crate::proxy::upstream::Ineligible::NoAdapter`]).
//!
//! SGLang replicas are not asked what they list: an adapter goes to one once, when the
//! router first checks it, and is taken as there from then on (a restart that keeps its
//! address is not noticed).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::{Method, StatusCode};
use http_body_util::BodyExt;

use super::Change;
use crate::fleet::Member;
use crate::proxy::body::full;
use crate::proxy::prompts::Client;
use crate::replicas::EngineKind;

/// A LoRA adapter loaded through the router: its name, and the load request's body and
/// headers (without hop-by-hop ones), sent again to replicas that lack it.
#[derive(Clone, Debug)]
pub struct Adapter {
    pub name: String,
    pub body: Bytes,
    pub headers: HeaderMap,
}

/// The adapters loaded through the router that every replica should have.
#[derive(Debug, Default)]
pub struct Registry {
    adapters: RwLock<Vec<Adapter>>,
    /// Whether there is any, so a request to the base model takes no lock.
    any: AtomicBool,
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
}

/// Gives `member` the adapters of `registry` it lacks (see the module docs), and marks those
/// it has.
pub async fn catch_up(member: &Member, client: &Client, registry: &Registry, timeout: Duration) {
    let adapters = registry.all();
    let Some(latest) = adapters.last() else { return };
    let spec = &member.replica.spec;
    let listed = match spec.engine {
        EngineKind::Sglang => None,
        // The latest load's credentials, for replicas started with `--api-key`.
        _ => match listed_models(client, &spec.http_url, &latest.headers, timeout).await {
            Listed::Models(listed) => Some(listed),
            // A replica that refuses the credentials cannot be shown to have any, and would
            // refuse the adapter's requests too.
            Listed::Refused => Some(HashSet::new()),
            // Not this time (it will be asked again at the next check).
            Listed::Unreachable => return,
        },
    };
    for adapter in &adapters {
        let has = match &listed {
            Some(listed) => listed.contains(&adapter.name),
            None => member.upstream.has_adapter(&adapter.name),
        };
        if !has {
            member.upstream.mark_adapter(&adapter.name, false);
            let url = format!("{}{}", spec.http_url, Change::Load.path(spec.engine));
            let sent =
                send(client, Method::POST, &url, &adapter.headers, adapter.body.clone(), timeout).await;
            match sent {
                Some((status, body)) if status.is_success() || Change::Load.there_already(status, &body) => {
                    tracing::info!(replica = %spec.name, lora_name = adapter.name, "LoRA adapter loaded on a replica that lacked it");
                }
                answer => {
                    let answer = answer.map(|(s, b)| format!("{s} {}", String::from_utf8_lossy(&b).trim()));
                    tracing::warn!(replica = %spec.name, lora_name = adapter.name, ?answer, "cannot load the LoRA adapter on a replica that lacks it");
                    continue;
                }
            }
        }
        member.upstream.mark_adapter(&adapter.name, true);
    }
}

/// What a replica's `GET /v1/models` said.
enum Listed {
    /// The model ids it lists.
    Models(HashSet<String>),
    /// An answer that is not a list (a 401, say).
    Refused,
    /// No answer.
    Unreachable,
}

async fn listed_models(client: &Client, base: &str, credentials: &HeaderMap, timeout: Duration) -> Listed {
    let mut headers = HeaderMap::new();
    if let Some(authorization) = credentials.get(header::AUTHORIZATION) {
        headers.insert(header::AUTHORIZATION, authorization.clone());
    }
    let url = format!("{base}/v1/models");
    let Some((status, body)) = send(client, Method::GET, &url, &headers, Bytes::new(), timeout).await else {
        return Listed::Unreachable;
    };
    #[derive(serde::Deserialize)]
    struct Models {
        data: Vec<Card>,
    }
    #[derive(serde::Deserialize)]
    struct Card {
        id: String,
    }
    match serde_json::from_slice::<Models>(&body) {
        Ok(models) if status == StatusCode::OK => {
            Listed::Models(models.data.into_iter().map(|card| card.id).collect())
        }
        _ => Listed::Refused,
    }
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
        Some((status, response.into_body().collect().await.ok()?.to_bytes()))
    };
    tokio::time::timeout(timeout, exchange).await.ok()?
}
