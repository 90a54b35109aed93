//! LoRA adapters loaded and unloaded at run time (vLLM's `POST /v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`): the router sends the
//! request to every replica, not to one, so that any replica it routes the adapter's
//! requests to serves it; and it names the adapter's cache namespace from then on (its blocks
//! hash apart from the base model's, as the replicas hash them), and lists it in
//! `/v1/models`.
//!
//! The answer: every replica's success is a 200 (the first one's body); when none succeeded
//! and all answered alike (an adapter already loaded, not found), that answer; anything else
//! is a 502 that names each replica's outcome. The router counts the adapter as loaded when
//! some replica loaded it and every other refused it (already loaded, most likely), and as
//! unloaded when some replica unloaded it and every other had not got it.
//!
//! Not covered: a replica that joins later does not get the adapter, and another router in
//! front of the same fleet does not learn of it (its requests still route, on load and on
//! the base model's namespace).

use bytes::Bytes;
use futures::future::join_all;
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};
use http_body_util::BodyExt;

use super::ProxyState;
use super::body::{ProxyBody, full};
use super::error::ProxyError;
use super::pool::Pool;

/// Whether `path` is one of the two, and which.
pub fn route(path: &str) -> Option<Change> {
    match path {
        "/v1/load_lora_adapter" => Some(Change::Load),
        "/v1/unload_lora_adapter" => Some(Change::Unload),
        _ => None,
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Change {
    Load,
    Unload,
}

/// One replica's answer, or why there was none.
struct Outcome {
    replica: String,
    answer: Result<(StatusCode, Bytes), String>,
}

/// Sends `body` (the client's request) to every replica and answers as the module says.
pub async fn fan_out(
    state: &ProxyState,
    pool: &std::sync::Arc<Pool>,
    change: Change,
    path: &str,
    body: Bytes,
) -> Result<Response<ProxyBody>, ProxyError> {
    #[derive(serde::Deserialize)]
    struct Named {
        lora_name: String,
    }
    let name = serde_json::from_slice::<Named>(&body)
        .map_err(|e| ProxyError::Refused(format!("'lora_name' must be given as a string: {e}")))?
        .lora_name;
    let members = state.fleet().members();
    if members.is_empty() {
        return Err(ProxyError::Unavailable("no replicas are configured".into()));
    }
    let mut headers = HeaderMap::new();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    let timeout = state.forward.first_byte_timeout;
    let asks = members.iter().map(|member| {
        let (body, headers) = (body.clone(), &headers);
        async move {
            let url = format!("{}{path}", member.replica.spec.http_url);
            let answer = async {
                let uri: http::Uri = url.parse().map_err(|e| format!("bad replica URL {url:?}: {e}"))?;
                let exchange = async {
                    let response = pool
                        .send_head(&Method::POST, &uri, headers, super::http1::Outgoing::Full(body))
                        .await
                        .map_err(|e| e.to_string())?;
                    let status = response.status();
                    let bytes = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
                    Ok((status, bytes))
                };
                tokio::time::timeout(timeout, exchange)
                    .await
                    .map_err(|_| format!("no answer within {timeout:?}"))?
            };
            Outcome { replica: member.replica.spec.name.clone(), answer: answer.await }
        }
    });
    let outcomes = join_all(asks).await;
    let ok = |o: &&Outcome| o.answer.as_ref().is_ok_and(|(status, _)| status.is_success());
    let refused =
        |o: &&Outcome, expected: StatusCode| o.answer.as_ref().is_ok_and(|(status, _)| *status == expected);
    let done = outcomes.iter().filter(ok).count();
    // Refusals that mean the fleet is where the change wanted it.
    let fine = match change {
        Change::Load => outcomes.iter().filter(|o| refused(o, StatusCode::BAD_REQUEST)).count(),
        Change::Unload => outcomes.iter().filter(|o| refused(o, StatusCode::NOT_FOUND)).count(),
    };
    let tokenization = state.decider.prompts.tokenization();
    if done > 0 && done + fine == outcomes.len() {
        match change {
            Change::Load => tokenization.add_lora_adapter(&name),
            Change::Unload => tokenization.remove_lora_adapter(&name),
        };
        tracing::info!(lora_name = name, ?change, replicas = done, "LoRA adapter change sent to the fleet");
    }
    if done == outcomes.len() {
        let (status, bytes) = outcomes.into_iter().find_map(|o| o.answer.ok()).unwrap_or_default();
        return Ok(passed_on(status, bytes));
    }
    let first = outcomes[0].answer.as_ref().ok().map(|(status, _)| *status);
    if done == 0
        && first.is_some()
        && outcomes.iter().all(|o| o.answer.as_ref().ok().map(|(s, _)| *s) == first)
    {
        let (status, bytes) = outcomes.into_iter().find_map(|o| o.answer.ok()).unwrap_or_default();
        return Ok(passed_on(status, bytes));
    }
    let said: Vec<String> = outcomes
        .iter()
        .map(|o| match &o.answer {
            Ok((status, bytes)) => {
                format!("{}: {status} {}", o.replica, String::from_utf8_lossy(bytes).trim())
            }
            Err(why) => format!("{}: {why}", o.replica),
        })
        .collect();
    Err(ProxyError::FanOut(format!(
        "the adapter change reached {done} of {} replicas: {}",
        outcomes.len(),
        said.join("; ")
    )))
}

/// A replica's answer as the router's.
fn passed_on(status: StatusCode, bytes: Bytes) -> Response<ProxyBody> {
    let mut response = Response::new(full(bytes));
    *response.status_mut() = status;
    response
}
