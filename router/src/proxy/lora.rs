//! LoRA adapters loaded and unloaded at run time (vLLM's `POST /v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): the router sends the
//! request to every replica, not to one, so that any replica it routes the adapter's
//! requests to serves it; and it names the adapter's cache namespace from then on (its blocks
//! hash apart from the base model's, as the replicas hash them), and lists it in
//! `/v1/models`.
//!
//! Off unless the router runs with `--lora-updates` (403 otherwise): it lets any client of
//! the router change every replica. Changes go one at a time, each to every replica at once,
//! with the client's headers (its `Authorization` for replicas started with `--api-key`), to
//! vLLM's paths or SGLang's (`/load_lora_adapter`, `/unload_lora_adapter`) by engine.
//!
//! The answer: every replica's success is a 200 (the first one's body). The fleet is where
//! the change wanted it when some replica made the change and every other was there already
//! (vLLM's 400 "has already been loaded", its 404 for an adapter to unload that is not
//! loaded; SGLang's 400s for either): a 200 that says so. When none made it and all answered alike (all there already,
//! or none: one "already loaded" among other refusals would hide them), that answer; anything
//! else is a 502 that names each replica's outcome. The change runs to its end whether or not
//! its client waits, a shutdown included (in a task the server drains as it drains its
//! connections). The router names the adapter's namespace from when a replica has it (its
//! requests go only to replicas that have it, below), and stops with an unload any replica
//! took.
//!
//! A replica that joins later, restarts and loses the adapter, or was down when it was loaded,
//! is given it again ([`catch_up`]); until then the adapter's requests go to the replicas that
//! have it.
//!
//! Another router in front of the same fleet learns of the adapter from the replicas' own
//! lists ([`super::health`]), without the load request: it gives no replica the adapter.

use bytes::Bytes;
use futures::future::join_all;
use http::{Method, Response, StatusCode};

pub mod catch_up;

pub use catch_up::{Adapter, Registry};

use std::sync::Arc;

use super::ProxyState;
use super::body::{ProxyBody, full};
use super::error::ProxyError;
use super::pool::Pool;
use crate::fleet::Member;
use crate::replicas::EngineKind;

/// Whether `path` is one of the two (vLLM's or SGLang's spelling), and which.
pub fn route(path: &str) -> Option<Change> {
    match path {
        "/v1/load_lora_adapter" | "/load_lora_adapter" => Some(Change::Load),
        "/v1/unload_lora_adapter" | "/unload_lora_adapter" => Some(Change::Unload),
        _ => None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Load,
    Unload,
}

impl Change {
    /// The path of the change on a replica of `engine`.
    fn path(self, engine: EngineKind) -> &'static str {
        match (self, engine) {
            (Change::Load, EngineKind::Sglang) => "/load_lora_adapter",
            (Change::Unload, EngineKind::Sglang) => "/unload_lora_adapter",
            (Change::Load, _) => "/v1/load_lora_adapter",
            (Change::Unload, _) => "/v1/unload_lora_adapter",
        }
    }

    /// Whether a replica's refusal means it is where the change wanted it already: vLLM's
    /// 400 "has already been loaded" and 404 "cannot be found", SGLang's 400 "already exists"
    /// and "does not exist". (Not a 404 of another kind: a vLLM without runtime updates has no
    /// such route, and is not without the adapter for it.)
    fn there_already(self, status: StatusCode, body: &[u8]) -> bool {
        let says = |words: &[&[u8]]| words.iter().any(|words| memchr::memmem::find(body, words).is_some());
        match (self, status) {
            (Change::Load, StatusCode::BAD_REQUEST) => says(&[b"already been loaded", b"already exists"]),
            (Change::Unload, StatusCode::NOT_FOUND) => says(&[b"cannot be found"]),
            (Change::Unload, StatusCode::BAD_REQUEST) => says(&[b"does not exist"]),
            _ => false,
        }
    }
}

/// Whether changes may go through (they take their turn one at a time, [`Registry::change`]).
#[derive(Debug, Default)]
pub struct Updates {
    pub enabled: bool,
}

impl Updates {
    pub fn new(enabled: bool) -> Self {
        Self { enabled }
    }
}

/// One replica's answer, or why there was none.
struct Outcome {
    replica: String,
    answer: Result<Answer, String>,
}

/// A replica's answer: its status, body and content type.
#[derive(Default)]
struct Answer {
    status: StatusCode,
    body: Bytes,
    content_type: Option<http::HeaderValue>,
}

/// Refuses adapter changes unless the router was started with `--lora-updates`.
pub fn check_enabled(state: &ProxyState) -> Result<(), ProxyError> {
    match state.lora.enabled {
        true => Ok(()),
        false => Err(ProxyError::Forbidden(
            "LoRA adapter changes through the router are off (start it with --lora-updates)".into(),
        )),
    }
}

/// Sends the client's request (`parts`, `body`) to every replica and answers as the module
/// says.
pub async fn fan_out(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    change: Change,
    (parts, body): (http::request::Parts, Bytes),
    (request_id, slot): (&str, Option<super::forward::Slot>),
) -> Result<Response<ProxyBody>, ProxyError> {
    check_enabled(state)?;
    #[derive(serde::Deserialize)]
    struct Named {
        lora_name: String,
    }
    let name = serde_json::from_slice::<Named>(&body)
        .map_err(|e| ProxyError::Refused(format!("'lora_name' must be given as a string: {e}")))?
        .lora_name;
    // An adapter by the served model's name would take its requests for its own.
    if name == state.decider.prompts.tokenization().base_model() {
        return Err(ProxyError::Refused(format!(
            "'lora_name' {name:?} is the served model's name; name the adapter otherwise"
        )));
    }
    if state.fleet().members().is_empty() {
        return Err(ProxyError::Unavailable("no replicas are configured".into()));
    }
    // Run to its end whether or not the client waits for it (a client that times out drops
    // this future): replicas changed and the router's records left behind would disagree,
    // and its catch-up would then undo an unload or never finish a load. The server drains
    // the task at shutdown, as it drains connections.
    let background = parts.extensions.get::<kvroute_proto::serve::Background>().cloned();
    let (_, headers) = super::forward::upstream_head(parts, request_id, &state.forward);
    let apply = apply(state.clone(), pool.clone(), change, name, (headers, body));
    // The change holds its place under `--max-in-flight` until it is done, whether or not
    // its client waits: clients that left at once queued changes without bound.
    let apply = async move {
        let _slot = slot;
        apply.await
    };
    let task = match background {
        Some(background) => background.spawn(apply),
        None => tokio::spawn(apply),
    };
    let mut response =
        task.await.map_err(|e| ProxyError::FanOut(format!("the adapter change failed: {e}")))??;
    if let Ok(id) = http::HeaderValue::from_str(request_id) {
        response.headers_mut().insert(super::forward::X_REQUEST_ID, id);
    }
    Ok(response)
}

/// Sends the change to every member, records who has the adapter and answers.
async fn apply(
    state: Arc<ProxyState>,
    pool: Arc<Pool>,
    change: Change,
    name: String,
    (headers, body): (http::HeaderMap, Bytes),
) -> Result<Response<ProxyBody>, ProxyError> {
    let registry = state.fleet().adapters();
    let _turn = registry.change().await;
    // The members when its turn comes: one that joined while it waited (behind catch-ups of
    // their own) is sent the change too, and counts toward whether the change reached every
    // replica (a 200).
    let members: Vec<Member> = state.fleet().members();
    if members.is_empty() {
        return Err(ProxyError::Unavailable("no replicas are configured".into()));
    }
    let timeout = state.forward.control_timeout;
    let pool = &pool;
    let asks = members.iter().map(|member| {
        let (body, headers) = (body.clone(), &headers);
        async move {
            let url = format!("{}{}", member.replica.spec.http_url, change.path(member.replica.spec.engine));
            let answer = async {
                let uri: http::Uri = url.parse().map_err(|e| format!("bad replica URL {url:?}: {e}"))?;
                let exchange = async {
                    let response = pool
                        .send_head(&Method::POST, &uri, headers, super::http1::Outgoing::Full(body))
                        .await
                        .map_err(|e| e.to_string())?;
                    let status = response.status();
                    let content_type = response.headers().get(http::header::CONTENT_TYPE).cloned();
                    let body =
                        super::body::read_at_most(response.into_body(), super::body::REPLICA_ANSWER_BYTES)
                            .await
                            .map_err(|e| e.to_string())?;
                    Ok(Answer { status, body, content_type })
                };
                tokio::time::timeout(timeout, exchange)
                    .await
                    .map_err(|_| format!("no answer within {timeout:?}"))?
            };
            Outcome { replica: member.replica.spec.name.clone(), answer: answer.await }
        }
    });
    let outcomes = join_all(asks).await;
    let status = |o: &Outcome| o.answer.as_ref().ok().map(|a| a.status);
    let success = |o: &Outcome| status(o).is_some_and(|s| s.is_success());
    let is_there = |o: &Outcome| o.answer.as_ref().is_ok_and(|a| change.there_already(a.status, &a.body));
    for (member, outcome) in members.iter().zip(&outcomes) {
        if success(outcome) || is_there(outcome) {
            member.upstream.mark_adapter(&name, change == Change::Load);
        }
    }
    let done = outcomes.iter().filter(|o| success(o)).count();
    let there = outcomes.iter().filter(|o| is_there(o)).count();
    // Once some replica has it (or, for an unload, some replica is without it), the adapter
    // is kept for replicas that lack it (or no longer), whether every replica took the change
    // or not: one that was down gets it when it is back.
    if done + there > 0 {
        match change {
            // The load a replica took is the one to repeat; one that every replica refused as
            // there already (another path, say) replaces nothing.
            Change::Load if done > 0 || !registry.contains(&name) => {
                registry.insert(Adapter::new(name.clone(), body, &headers))
            }
            Change::Load => {}
            Change::Unload => registry.remove(&name),
        }
    }
    // Requests are hashed in the adapter's namespace while the router keeps it: they go only
    // to replicas that have it, which key its blocks apart from the base model's. From a load
    // any replica took until an unload any replica took.
    let tokenization = state.decider.prompts.tokenization();
    match change {
        Change::Load if done + there > 0 => {
            tokenization.add_lora_adapter(&name);
        }
        Change::Unload if done + there > 0 => {
            tokenization.remove_lora_adapter(&name);
        }
        _ => {}
    }
    if done + there == outcomes.len() {
        tracing::info!(lora_name = name, ?change, done, there, "LoRA adapter change reached every replica");
    }
    if done == outcomes.len() || done + there == outcomes.len() && done > 0 {
        let first = outcomes.into_iter().find_map(|o| o.answer.ok().filter(|a| a.status.is_success()));
        return Ok(passed_on(first.unwrap_or_default()));
    }
    // Every replica refused it alike (all had it already, or none takes the request): their
    // answer. One "there already" among other refusals would hide theirs: that is a fan-out
    // failure, below.
    let first = status(&outcomes[0]);
    let alike = outcomes.iter().all(|o| status(o) == first);
    if done == 0 && first.is_some() && alike && (there == 0 || there == outcomes.len()) {
        return Ok(passed_on(outcomes.into_iter().find_map(|o| o.answer.ok()).unwrap_or_default()));
    }
    let said: Vec<String> = outcomes
        .iter()
        .map(|o| match &o.answer {
            Ok(a) => format!("{}: {} {}", o.replica, a.status, String::from_utf8_lossy(&a.body).trim()),
            Err(why) => format!("{}: {why}", o.replica),
        })
        .collect();
    Err(ProxyError::FanOut(format!(
        "the adapter change reached {done} of {} replicas ({there} were there already): {}",
        outcomes.len(),
        said.join("; ")
    )))
}

/// A replica's answer as the router's (the request id is added by [`fan_out`]).
fn passed_on(answer: Answer) -> Response<ProxyBody> {
    let mut response = Response::new(full(answer.body));
    *response.status_mut() = answer.status;
    if let Some(content_type) = answer.content_type {
        response.headers_mut().insert(http::header::CONTENT_TYPE, content_type);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's and SGLang's answers for a replica where the change is made already; not a
    /// route's 404 (a vLLM without runtime updates) nor another refusal.
    #[test]
    fn there_already_in_either_engines_words() {
        let there = |change: Change, status: u16, body: &str| {
            change.there_already(StatusCode::from_u16(status).unwrap(), body.as_bytes())
        };
        let vllm_loaded = r#"{"error":{"message":"The lora adapter 'sql' has already been loaded."}}"#;
        let sglang_exists = r#"{"error":"LoRA with name sql already exists. Loaded LoRAs: ['sql']"}"#;
        assert!(there(Change::Load, 400, vllm_loaded) && there(Change::Load, 400, sglang_exists));
        let vllm_missing = r#"{"error":{"message":"The lora adapter 'sql' cannot be found."}}"#;
        let sglang_missing = r#"{"error":"LoRA with name sql does not exist. Loaded LoRAs: []"}"#;
        assert!(there(Change::Unload, 404, vllm_missing) && there(Change::Unload, 400, sglang_missing));
        assert!(!there(Change::Unload, 404, r#"{"detail":"Not Found"}"#), "no such route");
        assert!(!there(Change::Unload, 400, vllm_loaded));
        assert!(!there(Change::Load, 400, r#"{"error":{"message":"No adapter found at the path"}}"#));
        assert!(!there(Change::Load, 404, vllm_missing));
    }
}
