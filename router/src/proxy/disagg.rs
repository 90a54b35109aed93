//! Prefill/decode disaggregation, as vLLM's NixlConnector is driven over HTTP (vLLM's own
//! proxies, llm-d's decode sidecar): a prompt is computed on a prefill replica, its KV pulled
//! by the decode replica that generates the answer.
//!
//! A fleet disaggregates once a replica has a role other than `both` (`role = "prefill"` or
//! `"decode"` in its config, `--replica ...,role=..`, `AddReplica`, or the pod annotation
//! `kvroute.io/role`). A prefill replica then takes prefills only: every other request goes to
//! the replicas that decode (`decode`, `both`). A completion or chat request goes as follows:
//!
//! 1. Its decode replica is decided as any request's replica is, among the replicas that
//!    decode, on their own caches: a decode replica caches what it pulled, so a
//!    conversation's next turn finds its prefix there.
//! 2. When that replica lacks fewer than `--pd-min-prefill-tokens` of the prompt's tokens, it
//!    prefills them itself: a round trip to another replica would cost more.
//! 3. Else the prefill replica is decided among those that prefill (`prefill`, `both`; the
//!    decode replica and SGLang's replicas excepted), on their caches and load, and credited
//!    as any choice is.
//!    It is sent the client's body with `max_tokens` 1 (and `max_completion_tokens` 1 if
//!    asked), `stream` false, without `stream_options`, `min_tokens`,
//!    `min_completion_tokens`, `logprobs`, `top_logprobs` and `echo`, and with
//!    `kv_transfer_params` `{"do_remote_decode": true, ...}`, under the request's id. It is
//!    forwarded as any request is (retried on the next prefill replica, logged with `hop`
//!    `prefill`, its predicted and realized cached tokens counted in the hit rate), but gives
//!    up after `--pd-prefill-timeout-ms` rather than the first-byte timeout, and its retries
//!    wait for no room: the decode replica's place is held meanwhile.
//! 4. Its answer's `kv_transfer_params` are added to the client's body, which goes to the
//!    decode replica; that answer streams back to the client with `x-kvroute-prefill-replica`
//!    naming the prefill replica, `x-kvroute-prefill-cached-tokens` what it reported cached,
//!    and `x-kvroute-predicted-cached-tokens` what the router predicted there. The decode
//!    replica's usage is the client's as it is, but not counted in the hit rate: vLLM's
//!    reports every pulled token as cached.
//!
//! A prefill that cannot be had (no prefill replica with room, a failure, a 5xx, a 4xx of the
//! replica's own such as an adapter it lacks, a timeout, an answer without params: a replica
//! without a connector) leaves the request to its decode replica, which prefills it; a
//! prefill replica's 400, 413 or 422 (the request's own fault) is the client's answer, and
//! the request goes no further. No retry of the decode with the params goes to the prefill
//! replica (a `both` one could be a candidate). A decode replica that failed once it may have
//! had the request (it answered 503, or the connection closed after it was sent) may have
//! pulled the KV, and the prefill replica freed those blocks then: the retry goes without the
//! params, and its replica prefills the prompt itself (the cost of a prefill, where a 503
//! was an overloaded replica's that pulled nothing: the router cannot tell them apart). Each
//! outcome is counted in `kvroute_router_prefills_total`.
//!
//! SGLang's replicas (`engine = "sglang"`) hand the KV over through a bootstrap room instead.
//! A request decided on an SGLang replica of role `decode` (which cannot prefill: it refuses a
//! request without a room) is sent to it and, at the same time, to an SGLang replica of role
//! `prefill`, decided on their caches and load and credited; both bodies name the prefill
//! replica's host (`bootstrap_host`), its `bootstrap_port` (the replica's `bootstrap-port`;
//! null: the decode replica's own) and a random `bootstrap_room` below 2^63, as SGLang's
//! router sends them; a completion's batch of prompts is split too, with a list of each, a
//! room a prompt. The prefill's body is rewritten as above (one token, whole, without the
//! client's own params), and is not retried elsewhere: the decode replica waits for that
//! replica. SGLang's prefill replica answers once it handed the KV over; the decode's answer
//! goes to the client after it, with the same headers. A prefill's failure (its error answer,
//! a failure to connect, `--pd-prefill-timeout-ms`) is the client's answer and ends the
//! decode (a timeout does not count toward the prefill replica's ejection: its answer waits
//! on the decode replica); so does a decode replica's error end its prefill. While every
//! prefill replica is at `--max-in-flight-per-replica`, the request waits in line for one as
//! any request waits for room (its decode replica's place held); with no prefill replica to
//! be had, it ends with a 503. The decode is not retried elsewhere either (its replica
//! may have taken the room's KV before it failed). In a fleet with SGLang decode replicas, a
//! request that is not split (below), which they would refuse, is decided among the replicas
//! that need no room (`both` ones, vLLM's), waiting for their room if need be, and retried
//! among them only; with none, a 503 says why. So is a `prompt_embeds` completion. (Several
//! choices, `n`, are not split: SGLang's own router sends a chat's choices a room each, but
//! its servers, in the versions read, give every choice of a prompt its first room, which
//! hangs: sglang PRs 24223, 26486.)
//! SGLang's native `/generate` is split so too, a batch's prompts a room each: its prefill's
//! copy asks for one new token (`sampling_params.max_new_tokens`, each prompt's) whole, without
//! `return_logprob` and the like; one that asks for its prompt's logprobs (`return_logprob`
//! with a `logprob_start_len` of 0 or more) is not split. Passthrough requests still go by load
//! to any replica that decodes. A client's own `bootstrap_host`, `bootstrap_port` and
//! `bootstrap_room` are dropped as its `kv_transfer_params` are.
//!
//! Not split: requests of several prompts (but through SGLang's rooms) or choices (`n`), chats
//! with media, requests for the prompt's logprobs (`prompt_logprobs`, `echo` with `logprobs`:
//! only the replica that computed the prompt has them), and the Messages and Responses APIs
//! (vLLM's proxies split completions and chats only). In a fleet that disaggregates, a client's own
//! `kv_transfer_params` are dropped: they would have a replica pull from, or hold blocks for,
//! whatever they name. The bodies sent are rewritten through `serde_json`: their keys keep
//! their order, a repeated key comes once (its last value, as vLLM reads it).
//!
//! Costs: a split request is two decisions (`kvroute_router_decisions_total`,
//! `decision_seconds`) and two upstream requests (time to first byte, duration). Its decode
//! replica is charged the prompt's prefill while the prefill runs (its place is held), then
//! each prompt's last token only (an SGLang one, those from the start); its recent prompt
//! tokens count the whole prompt.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response};
use http_body_util::BodyExt;
use kvroute_proto::openai::Endpoint;
use kvroute_proto::openai::request::{asks_prompt_logprobs, parse_object};
use serde_json::{Map, Value, json};

use super::ProxyState;
use super::access::Arrival;
use super::body::{self, ProxyBody};
use super::error::ProxyError;
use super::forward::{self, Admitted, ForwardConfig, X_KVROUTE_PREDICTED, X_KVROUTE_REPLICA};
use super::pool::Pool;
use super::queue::{Line, Queue};
use super::route::{Hop, Plan, Prepared, RequestLimits};
use crate::metrics::OutcomeLabel;
use kvroute_proto::ReplicaId;

/// The prefill replica of a request decoded after a remote prefill.
pub const X_KVROUTE_PREFILL_REPLICA: HeaderName = HeaderName::from_static("x-kvroute-prefill-replica");
/// The prompt tokens the prefill replica reported cached (its `usage`): the decode replica
/// reports every pulled token as cached.
pub const X_KVROUTE_PREFILL_CACHED: HeaderName = HeaderName::from_static("x-kvroute-prefill-cached-tokens");

/// Largest prefill answer read (one token, without logprobs), and largest refusal passed on.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// A remote prefill, as the decode replica's response names it.
#[derive(Debug)]
pub struct Remote {
    /// The prefill replica: no retry of the decode with the params goes there (they name it).
    pub id: Option<ReplicaId>,
    replica: Option<HeaderValue>,
    predicted: Option<HeaderValue>,
    cached: Option<u64>,
    /// Through a bootstrap room (SGLang's): only an SGLang decode replica takes it over.
    bootstrap: bool,
    /// The client's body, for a decode replica to prefill itself: what a retry sends once a
    /// decode replica may have pulled the prefill (none through a room, whose decode goes
    /// nowhere else).
    pub alone: Option<Bytes>,
}

impl Remote {
    /// Whether `replica` may take its decode over on a retry: not after a bootstrap room (the
    /// first decode replica may have taken the room's KV already), nor on the replica that
    /// prefilled it, nor on an SGLang decode replica (which refuses a request without a room).
    pub fn decodable_on(&self, replica: &crate::replicas::Replica) -> bool {
        !self.bootstrap && self.id != Some(replica.id) && !replica.spec.waits_for_a_room()
    }

    /// Names the prefill replica, and puts its predicted and reported cached tokens in place
    /// of the decode replica's.
    pub fn headers(&self, headers: &mut HeaderMap) {
        if let Some(replica) = &self.replica {
            headers.insert(X_KVROUTE_PREFILL_REPLICA, replica.clone());
        }
        if let Some(predicted) = &self.predicted {
            headers.insert(X_KVROUTE_PREDICTED, predicted.clone());
        }
        if let Some(cached) = self.cached {
            headers.insert(X_KVROUTE_PREFILL_CACHED, HeaderValue::from(cached));
        }
    }
}

/// Why a request that decodes has nowhere to go in a fleet of prefill replicas only.
pub const NO_DECODER: &str = "no replica decodes: every one is of role prefill";

/// Why a request that is not split has nowhere to go in a fleet whose replicas that decode
/// are SGLang decode replicas, which refuse it.
pub const NO_ROOMLESS: &str = "no replica takes a request that is not split into prefill and decode: \
     SGLang's decode replicas take none without a bootstrap room (requests of several choices, \
     chats with media, requests for the prompt's logprobs, the Messages and Responses APIs)";

/// Whether a fleet of `members` disaggregates: one has a role other than `both`.
pub fn disaggregates(members: &[crate::fleet::Member]) -> bool {
    members.iter().any(|member| member.replica.spec.role != crate::replicas::Role::Both)
}

/// What the access log calls `plan`'s hop: `prefill` ahead of a request, `decode` after one.
pub fn hop(plan: &Plan) -> Option<&'static str> {
    match plan.hop {
        Hop::Prefill(_) | Hop::Bootstrap => Some("prefill"),
        Hop::Whole | Hop::Roomless if plan.prefilled_by.is_some() => Some("decode"),
        Hop::Whole | Hop::Roomless => None,
    }
}

/// What goes to the decode replica: its body, and an SGLang prefill sent alongside it.
pub struct Decode<'a> {
    pub body: Bytes,
    pub alongside: Option<Alongside<'a>>,
}

/// An SGLang prefill sent at the same time as its decode ([`together`]): the prompt tokens
/// its replica reported cached, or why the request ends there.
pub type Alongside<'a> = Pin<Box<dyn Future<Output = Result<Option<u64>, Failure>> + Send + 'a>>;

/// Why a request ends at its prefill.
pub enum Failure {
    /// The prefill replica's answer is the client's.
    Answer(Box<Response<ProxyBody>>),
    /// The router's error.
    Error(ProxyError),
}

impl Failure {
    /// The client's answer.
    pub fn answer(self) -> Result<Response<ProxyBody>, ProxyError> {
        match self {
            Failure::Answer(answer) => Ok(*answer),
            Failure::Error(e) => Err(e),
        }
    }
}

fn count(state: &ProxyState, outcome: &'static str) {
    state.decider.metrics.prefills.get_or_create(&OutcomeLabel { outcome }).inc();
}

/// How the request a plan decided is split (module docs).
pub enum Split {
    /// Its fleet does not disaggregate.
    Whole,
    /// Not split: several choices (or prompts, but through SGLang's rooms), media, the prompt's
    /// logprobs, another API. It goes without a bootstrap room ([`Hop::Roomless`] if it was
    /// decided on a replica that needs one).
    NotSplit,
    /// Its decode replica holds all but a few of its prompt's tokens: it prefills them.
    Cached,
    /// Prefilled first on one of [`Hop::Prefill`], then decoded with its params (vLLM's).
    Remote { decode: ReplicaId, request: Map<String, Value> },
    /// Prefilled on one of [`Hop::Bootstrap`] alongside its decode (SGLang's).
    Bootstrap { request: Map<String, Value> },
}

impl Split {
    /// How `plan`'s request to `endpoint`, `body`, is split.
    pub fn of(plan: &Plan, endpoint: Endpoint, body: &[u8]) -> Split {
        if !plan.disaggregated {
            return Split::Whole;
        }
        let shape = Shape {
            endpoint,
            prompts: plan.prompts,
            choices: plan.choices,
            unhashed: plan.unhashed_tokens.is_some(),
        };
        let Some(decode) = plan.chosen().map(|c| &c.member.replica) else { return Split::NotSplit };
        let rooms = decode.spec.waits_for_a_room();
        // (Decided among replicas that need no room: it was found never split then.)
        if plan.hop == Hop::Roomless || shape.whole(rooms) {
            return Split::NotSplit;
        }
        if !rooms {
            let lacking = plan.prompt_tokens.saturating_sub(plan.predicted_cached_tokens(0));
            if lacking < plan.routing.pd_min_prefill_tokens {
                return Split::Cached;
            }
        }
        match prefillable(endpoint, body) {
            None => Split::NotSplit,
            Some(request) if rooms => Split::Bootstrap { request },
            Some(request) => Split::Remote { decode: decode.id, request },
        }
    }

    /// Its spelling in `Explain` and in `kvroute_router_prefills_total`'s outcomes.
    pub fn as_str(&self) -> &'static str {
        match self {
            Split::Whole => "whole",
            Split::NotSplit => "not_split",
            Split::Cached => "cached",
            Split::Remote { .. } => "remote",
            Split::Bootstrap { .. } => "bootstrap",
        }
    }

    /// The replicas its prefill is decided among, if it has one.
    pub fn prefill_hop(&self) -> Option<Hop> {
        match self {
            Split::Remote { decode, .. } => Some(Hop::Prefill(*decode)),
            Split::Bootstrap { .. } => Some(Hop::Bootstrap),
            _ => None,
        }
    }
}

/// Sends the prefill of the request `plan` decided ahead to a prefill replica, if its fleet
/// disaggregates and the request is worth it (module docs). What goes to the decode replica
/// (the body with the prefill's params, or the client's without any of its own; an SGLang
/// prefill, sent with it); `Err`, the prefill replica's refusal, which is the client's answer.
pub async fn prefill<'a>(
    (state, pool): (&'a Arc<ProxyState>, &'a Arc<Pool>),
    (prepared, plan): (&Prepared, &mut Plan),
    endpoint: Endpoint,
    (parts, body): (&http::request::Parts, &Bytes),
    (request_id, received): (&'a str, Option<Arrival>),
    line: &'a Line,
) -> Result<Decode<'a>, Failure> {
    let whole = |body| Ok(Decode { body, alongside: None });
    let count = |outcome| count(state, outcome);
    let local = || whole(without_own_params(body));
    let admitted = Admitted { request_id, slot: None, received };
    let (decode, request) = match Split::of(plan, endpoint, body) {
        Split::Whole => return whole(body.clone()),
        Split::NotSplit => {
            count("not_split");
            return roomless(state, (prepared, plan), line).await.and_then(|()| local());
        }
        Split::Cached => {
            count("cached");
            return local();
        }
        Split::Bootstrap { request } => {
            let sent = (endpoint, request, parts, body);
            return bootstrap((state, pool), (prepared, plan), sent, admitted, line).await;
        }
        Split::Remote { decode, request } => (decode, request),
    };
    let Some(sent) = for_prefill(endpoint, request, remote_decode()) else {
        count("not_split");
        return local();
    };
    let mut prefill = match state.decider.decide_hop(prepared, &RequestLimits::NONE, Hop::Prefill(decode)) {
        Ok(plan) => plan,
        Err(e) => {
            tracing::debug!(request_id, error = %e, "no prefill replica; the decode replica prefills");
            count("no_replica");
            return local();
        }
    };
    let forward = prefill_forward(state);
    // A retry of the prefill waits for no room (the decode replica's is held meanwhile): with
    // none, the decode replica prefills.
    let no_wait = Queue::new(0, None);
    let decider = &state.decider;
    let answered = forward::routed(
        pool,
        &forward,
        decider,
        &mut prefill,
        (parts.clone(), sent),
        admitted,
        (&no_wait, line),
    )
    .await;
    let response = match answered {
        Ok(response) => response,
        Err(e) => {
            tracing::warn!(request_id, error = %e, "prefill failed; the decode replica prefills");
            count("failed");
            return local();
        }
    };
    let status = response.status();
    // A success counted in the hit rate; else the decode replica's answer, which computes
    // the prompt, does.
    plan.counted = !status.is_success();
    if refuses(status) {
        let (head, answer) = response.into_parts();
        let Some(answer) = read(answer).await else {
            count("failed");
            return local();
        };
        count("refused");
        // Nothing goes to the decode replica.
        let_go(state, plan);
        return Err(Failure::Answer(Box::new(Response::from_parts(head, body::full(answer)))));
    }
    if !status.is_success() {
        tracing::warn!(request_id, %status, "prefill failed; the decode replica prefills");
        count("failed");
        return local();
    }
    let (head, answer) = response.into_parts();
    let (replica, predicted) =
        (head.headers.get(X_KVROUTE_REPLICA).cloned(), head.headers.get(X_KVROUTE_PREDICTED).cloned());
    let Some(answer) = read(answer).await else {
        tracing::warn!(request_id, "the prefill's answer was cut off; the decode replica prefills");
        count("failed");
        return local();
    };
    let answer = serde_json::from_slice::<Map<String, Value>>(&answer).ok();
    let prefilled_on = prefill
        .candidates
        .iter()
        .find(|c| replica.as_ref().is_some_and(|r| r == c.member.replica.spec.name.as_str()));
    let cached = answer
        .as_ref()
        .zip(prefilled_on)
        .and_then(|(answer, on)| on.member.upstream.cached_tokens(usage(answer), parts.uri.path()));
    let params = answer.and_then(|mut answer| answer.remove("kv_transfer_params")).filter(Value::is_object);
    match params.and_then(|params| with_fields(body, fields([("kv_transfer_params", params)]))) {
        Some(decoded) => {
            count("remote");
            let id = prefilled_on.map(|on| on.member.replica.id);
            let alone = Some(without_own_params(body));
            plan.prefilled_by = Some(Remote { id, replica, predicted, cached, bootstrap: false, alone });
            if let Some(load) = plan.load.as_mut() {
                load.prefilled_elsewhere(plan.prompts);
            }
            whole(decoded)
        }
        None => {
            // A replica without a connector answers every prefill so: said once, then counted.
            static SAID: AtomicBool = AtomicBool::new(false);
            let replica = replica.as_ref().and_then(|r| r.to_str().ok());
            let why = "a prefill replica answered without kv_transfer_params (started without \
                       --kv-transfer-config?); its requests are prefilled on their decode replicas, \
                       counted in kvroute_router_prefills_total{outcome=\"no_params\"}";
            match SAID.swap(true, Ordering::Relaxed) {
                false => tracing::warn!(request_id, replica, "{why}"),
                true => tracing::debug!(request_id, replica, "{why}"),
            }
            count("no_params");
            local()
        }
    }
}

/// Decides `plan`'s request again among replicas that take it without a bootstrap room, if it
/// was decided on an SGLang decode replica, which refuses it (it is not split), waiting in
/// `line` for room among them if need be.
async fn roomless(
    state: &ProxyState,
    (prepared, plan): (&Prepared, &mut Plan),
    line: &Line,
) -> Result<(), Failure> {
    if !plan.chosen().is_some_and(|chosen| chosen.member.replica.spec.waits_for_a_room()) {
        return Ok(());
    }
    let_go(state, plan);
    let mut decided = decide_waiting(state, prepared, Hop::Roomless, line).await.map_err(Failure::Error)?;
    decided.keeps_response = plan.keeps_response;
    *plan = decided;
    Ok(())
}

/// The decision of `prepared`'s `hop`, waiting in `line` (within the queue's limits, as for
/// the request's first decision) while every replica of the hop is at its limit.
async fn decide_waiting(
    state: &ProxyState,
    prepared: &Prepared,
    hop: Hop,
    line: &Line,
) -> Result<Plan, ProxyError> {
    let decide = || std::future::ready(state.decider.decide_hop(prepared, &RequestLimits::NONE, hop));
    let goes_to = |plan: &Plan| plan.chosen().map(|chosen| chosen.member.replica.id);
    let (waiters, metrics) = (state.fleet().waiters(), &state.decider.metrics);
    state.queue.until_room(waiters, (line, metrics), decide, goes_to).await
}

/// Ends the credit and the place `plan` took on the replica it holds them on (the one it
/// chose, or a retry's), where nothing goes (or nothing went: its request was dropped before
/// the replica answered).
pub fn let_go(state: &ProxyState, plan: &mut Plan) {
    state.decider.withdraw_credit(plan);
    plan.load = None;
}

/// A request's decision while its prefill is sent ahead: dropped before its decode is sent
/// (its client left meanwhile), the decode replica's credit and place end at once, not after
/// the credit's TTL: that replica never gets the prompt.
pub struct Prefilling<'a> {
    state: &'a ProxyState,
    pub plan: Plan,
    sent: bool,
}

impl<'a> Prefilling<'a> {
    pub fn new(state: &'a ProxyState, plan: Plan) -> Self {
        Self { state, plan, sent: false }
    }

    /// The decision, its decode about to be sent.
    pub fn sent(&mut self) -> &mut Plan {
        self.sent = true;
        &mut self.plan
    }
}

impl Drop for Prefilling<'_> {
    fn drop(&mut self) {
        if !self.sent {
            let_go(self.state, &mut self.plan);
        }
    }
}

/// How a prefill is forwarded: given up after `--pd-prefill-timeout-ms`.
fn prefill_forward(state: &ProxyState) -> ForwardConfig {
    ForwardConfig { first_byte_timeout: state.forward.prefill_timeout, ..state.forward.clone() }
}

/// The prefill of a request `plan` decided on an SGLang decode replica, sent alongside it
/// (module docs): to an SGLang prefill replica, both bodies naming it and one bootstrap room.
/// While every prefill replica is at its limit, the request waits in `line` (its decode
/// replica's place held).
async fn bootstrap<'a>(
    (state, pool): (&'a Arc<ProxyState>, &'a Arc<Pool>),
    (prepared, plan): (&Prepared, &mut Plan),
    (endpoint, request, parts, body): (Endpoint, Map<String, Value>, &http::request::Parts, &Bytes),
    admitted: Admitted<'a>,
    line: &'a Line,
) -> Result<Decode<'a>, Failure> {
    let mut prefill = match decide_waiting(state, prepared, Hop::Bootstrap, line).await {
        Ok(plan) => plan,
        Err(e) => {
            // The decode replica cannot prefill (it refuses a request without a room): nothing
            // goes there.
            count(state, "no_replica");
            let_go(state, plan);
            return Err(Failure::Error(e));
        }
    };
    // The decode replica waits for this replica's hand-over: no retry goes elsewhere.
    prefill.without_retries();
    let Some(on) = prefill.chosen().map(|on| on.member.clone()) else {
        return Err(Failure::Error(ProxyError::Unavailable("no SGLang replica of role prefill".into())));
    };
    // A data-parallel prefill replica's rank (named to it in a header), and its ranks.
    let rank = prefill.chosen().and_then(|on| on.rank).map(|rank| {
        let ranks = on.replica.ranks.get().map_or(1, |ranks| ranks.len());
        (rank, ranks)
    });
    // A batch (a list of prompts, of one too) has a list of rooms, one a prompt, as SGLang's
    // router sends it: SGLang reads each prompt's from a batch's lists.
    let room = || json!(bootstrap_room(rand::random(), rank));
    let (host, port) = (json!(host(&on.replica.spec.http_url)), json!(on.replica.spec.bootstrap_port));
    let named = match (plan.listed, plan.prompts) {
        (false, _) => {
            fields([("bootstrap_host", host), ("bootstrap_port", port), ("bootstrap_room", room())])
        }
        (true, k) => fields([
            ("bootstrap_host", Value::Array(vec![host; k as usize])),
            ("bootstrap_port", Value::Array(vec![port; k as usize])),
            ("bootstrap_room", (0..k).map(|_| room()).collect()),
        ]),
    };
    // The decode replica pulls from the prefill's rank: named, as SGLang's gateway names it
    // (an older SGLang reads it from the room, [`bootstrap_room`]).
    let mut to_decode = named.clone();
    if let Some((rank, _)) = rank {
        to_decode.insert("disagg_prefill_dp_rank".into(), json!(rank));
    }
    let (Some(sent), Some(decoded)) = (for_prefill(endpoint, request, named), with_fields(body, to_decode))
    else {
        // (Only if the request cannot be written again.) Nothing goes anywhere.
        count(state, "failed");
        let_go(state, &mut prefill);
        let_go(state, plan);
        return Err(Failure::Error(ProxyError::Unavailable("the request could not be rewritten".into())));
    };
    let predicted = prefill.predicted_cached_tokens(0);
    let replica = HeaderValue::from_str(&on.replica.spec.name).ok();
    let (id, predicted) = (Some(on.replica.id), Some(predicted.into()));
    plan.prefilled_by = Some(Remote { id, replica, predicted, cached: None, bootstrap: true, alone: None });
    // The prefill's answer counts in the hit rate.
    plan.counted = false;
    if let Some(load) = plan.load.as_mut() {
        load.prefilled_elsewhere(plan.prompts);
    }
    let parts = parts.clone();
    let path = parts.uri.path().to_owned();
    let alongside = async move {
        let (forward, no_wait) = (prefill_forward(state), Queue::new(0, None));
        let decider = &state.decider;
        let queue = (&no_wait, line);
        let answered =
            forward::routed(pool, &forward, decider, &mut prefill, (parts, sent), admitted, queue).await;
        let response = answered.map_err(|e| {
            count(state, "failed");
            Failure::Error(e)
        })?;
        let (status, (head, answer)) = (response.status(), response.into_parts());
        let Some(answer) = read(answer).await else {
            count(state, "failed");
            let reason = "its answer to the prefill was cut off".into();
            return Err(Failure::Error(ProxyError::Upstream {
                replica: on.replica.spec.name.clone(),
                reason,
            }));
        };
        if !status.is_success() {
            count(state, if refuses(status) { "refused" } else { "failed" });
            return Err(Failure::Answer(Box::new(Response::from_parts(head, body::full(answer)))));
        }
        count(state, "bootstrap");
        let answer = serde_json::from_slice::<Value>(&answer).ok();
        Ok(answer.and_then(|answer| on.upstream.cached_tokens(usage_of(&answer), &path)))
    };
    Ok(Decode { body: decoded, alongside: Some(Box::pin(alongside)) })
}

/// A bootstrap room from `random` bits: on a prefill replica's `rank` of `ranks`, one whose
/// remainder by `ranks` is `rank`, as SGLang's decode replicas without
/// `disagg_prefill_dp_rank` find the rank that holds a room's KV (`room % dp_size`).
fn bootstrap_room(random: u64, rank: Option<(u32, u32)>) -> u64 {
    // (62 bits: a room is an i64, and the rank added to a multiple stays one.)
    let room = random >> 2;
    match rank {
        Some((rank, ranks)) if ranks > 1 => room - room % u64::from(ranks) + u64::from(rank % ranks),
        _ => room,
    }
}

/// The host of `url` (`http://10.0.0.7:30000`: `10.0.0.7`; an IPv6 one in brackets), as an
/// SGLang decode replica reaches its prefill replica's bootstrap server.
fn host(url: &str) -> String {
    let authority = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = authority.split(['/', '?']).next().unwrap_or_default();
    let authority = authority.rsplit_once('@').map_or(authority, |(_, host)| host);
    match authority.strip_prefix('[') {
        Some(v6) => format!("[{}]", v6.split(']').next().unwrap_or_default()),
        None => authority.split(':').next().unwrap_or_default().to_owned(),
    }
}

/// The decode's answer once its SGLang prefill, sent `alongside`, answered too: with
/// `x-kvroute-prefill-cached-tokens`. A decode replica's error is the client's answer at once
/// (its prefill would wait for it in vain); a prefill's failure ends the decode.
pub async fn together(
    decode: impl Future<Output = Result<Response<ProxyBody>, ProxyError>>,
    mut alongside: Alongside<'_>,
) -> Together {
    let answered = |answer| Together { answer, decode_dropped: false };
    tokio::pin!(decode);
    let (decoded, cached) = tokio::select! {
        decoded = &mut decode => {
            let decoded = match decoded {
                Ok(decoded) => decoded,
                Err(e) => return answered(Err(e)),
            };
            if !decoded.status().is_success() {
                return answered(Ok(decoded));
            }
            (decoded, alongside.await)
        }
        prefilled = &mut alongside => match prefilled {
            Ok(cached) => match decode.await {
                Ok(decoded) => (decoded, Ok(cached)),
                Err(e) => return answered(Err(e)),
            },
            Err(failure) => return Together { answer: failure.answer(), decode_dropped: true },
        },
    };
    let mut decoded = decoded;
    answered(match cached {
        Ok(cached) => {
            if let Some(cached) = cached {
                decoded.headers_mut().insert(X_KVROUTE_PREFILL_CACHED, HeaderValue::from(cached));
            }
            Ok(decoded)
        }
        // (The decode's answer, dropped before its first data, withdraws its credit: its
        // replica drops the request. Had the prefill handed its KV over before it failed, the
        // decode replica's events bring the blocks back.)
        Err(failure) => failure.answer(),
    })
}

/// [`together`]'s outcome: the client's answer, and whether the decode was dropped before its
/// replica answered (its prefill failed first), where its credit is to end ([`let_go`]).
pub struct Together {
    pub answer: Result<Response<ProxyBody>, ProxyError>,
    pub decode_dropped: bool,
}

/// Whether a prefill replica's `status` is the request's own fault, which a decode replica
/// would find too: a malformed or too large request (another 4xx, a model the replica does
/// not serve, its rate limit or its key, is the replica's).
fn refuses(status: http::StatusCode) -> bool {
    use http::StatusCode as S;
    matches!(status, S::BAD_REQUEST | S::PAYLOAD_TOO_LARGE | S::UNPROCESSABLE_ENTITY)
}

/// An answer's usage, as [`super::upstream::Upstream::cached_tokens`] reads it (vLLM leaves
/// the cached tokens out when there are none; SGLang's `/generate` writes them in `meta_info`).
fn usage(answer: &Map<String, Value>) -> body::Usage {
    if let Some(meta) = answer.get("meta_info") {
        return body::Usage {
            cached_tokens: meta.get("cached_tokens").and_then(Value::as_u64),
            counted: meta.get("prompt_tokens").is_some_and(Value::is_u64),
        };
    }
    let usage = answer.get("usage");
    body::Usage {
        cached_tokens: usage.and_then(|u| u.get("prompt_tokens_details")?.get("cached_tokens")?.as_u64()),
        counted: usage.and_then(|u| u.get("prompt_tokens")).is_some_and(Value::is_u64),
    }
}

/// [`usage`] of an answer, or of a list of them (SGLang's `/generate` answers a batch so, of
/// one prompt too): the sum of their cached tokens, counted if each is.
fn usage_of(answer: &Value) -> body::Usage {
    match answer {
        Value::Object(answer) => usage(answer),
        Value::Array(answers) => {
            let each = answers.iter().map(|a| a.as_object().map(usage).unwrap_or_default());
            let none = body::Usage { cached_tokens: Some(0), counted: !answers.is_empty() };
            each.fold(none, |sum, u| body::Usage {
                cached_tokens: sum.cached_tokens.zip(u.cached_tokens).map(|(a, b)| a + b),
                counted: sum.counted && u.counted,
            })
        }
        _ => body::Usage::default(),
    }
}

/// An answer's body, if it ends within [`MAX_ANSWER_BYTES`].
async fn read(mut body: ProxyBody) -> Option<Bytes> {
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.ok()?.into_data() {
            bytes.extend_from_slice(&data);
        }
        if bytes.len() > MAX_ANSWER_BYTES {
            return None;
        }
    }
    Some(bytes.into())
}

/// What a vLLM prefill replica is asked: a prefill whose KV a decode replica will pull.
fn remote_decode() -> Map<String, Value> {
    let params = json!({
        "do_remote_decode": true,
        "do_remote_prefill": false,
        "remote_engine_id": null,
        "remote_block_ids": null,
        "remote_host": null,
        "remote_port": null,
    });
    fields([("kv_transfer_params", params)])
}

/// `pairs` as a JSON object's fields.
fn fields<const N: usize>(pairs: [(&str, Value); N]) -> Map<String, Value> {
    pairs.into_iter().map(|(key, value)| (key.to_owned(), value)).collect()
}

/// The client's `body` to `endpoint` as an object, if it is one and does not ask for the
/// prompt's logprobs (which only a replica that computed the prompt has): its prefill can go
/// elsewhere.
fn prefillable(endpoint: Endpoint, body: &[u8]) -> Option<Map<String, Value>> {
    let object: Map<String, Value> = serde_json::from_slice(body).ok()?;
    (!asks_prompt_logprobs(endpoint, body)).then_some(object)
}

/// What of a request, as it was read, says whether it may be split.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub endpoint: Endpoint,
    pub prompts: u32,
    /// Its `n`.
    pub choices: u32,
    /// A chat with media.
    pub unhashed: bool,
}

impl Shape {
    /// Whether it is never split: an API other than completions and chat (and SGLang's
    /// `/generate`, through `rooms`), media, several choices (`n`), or several prompts unless
    /// handed over through `rooms` (SGLang's, a room a prompt; vLLM's proxies split one prompt
    /// only).
    fn whole(self, rooms: bool) -> bool {
        let several = self.choices > 1 || (self.prompts > 1 && !rooms);
        let api = match self.endpoint {
            Endpoint::Completions | Endpoint::ChatCompletions => true,
            Endpoint::Generate => rooms,
            Endpoint::Messages | Endpoint::Responses => false,
        };
        !api || self.unhashed || several
    }

    /// Whether a request of this shape, `body`, is never split in front of SGLang's decode
    /// replicas (which refuse it then): [`Shape::whole`], or it asks for its prompt's logprobs.
    pub fn goes_without_a_room(self, body: &[u8]) -> bool {
        self.whole(true) || asks_prompt_logprobs(self.endpoint, body)
    }
}

/// The client's request to `endpoint` (its [`prefillable`] `object`) as a prefill replica is
/// sent it, with `named` (how it hands its KV over).
fn for_prefill(
    endpoint: Endpoint,
    mut object: Map<String, Value>,
    named: Map<String, Value>,
) -> Option<Bytes> {
    // What only the client's answer needs (its one token's logprobs would be thrown away).
    let answers_only: &[&str] = match endpoint {
        Endpoint::Generate => {
            one_new_token(&mut object);
            &[
                "return_logprob",
                "top_logprobs_num",
                "token_ids_logprob",
                "return_text_in_logprobs",
                "return_hidden_states",
            ]
        }
        _ => {
            object.insert("max_tokens".into(), json!(1));
            if object.contains_key("max_completion_tokens") {
                object.insert("max_completion_tokens".into(), json!(1));
            }
            &["stream_options", "min_tokens", "min_completion_tokens", "logprobs", "top_logprobs", "echo"]
        }
    };
    object.insert("stream".into(), json!(false));
    for key in answers_only {
        object.remove(*key);
    }
    drop_own(&mut object);
    object.extend(named);
    serde_json::to_vec(&object).ok().map(Bytes::from)
}

/// SGLang's `/generate` `object` asking for one new token (`sampling_params.max_new_tokens`,
/// each prompt's of a list), without `min_new_tokens` (which may not pass one).
fn one_new_token(object: &mut Map<String, Value>) {
    let one = |params: &mut Value| match params {
        Value::Object(params) => {
            params.insert("max_new_tokens".into(), json!(1));
            params.remove("min_new_tokens");
        }
        other => *other = json!({"max_new_tokens": 1}),
    };
    match object.entry("sampling_params").or_insert(Value::Null) {
        Value::Array(list) => list.iter_mut().for_each(one),
        params => one(params),
    }
}

/// The client's `body` with `named` (the prefill's params, or its bootstrap room), for the
/// decode replica; the client's own dropped.
fn with_fields(body: &[u8], named: Map<String, Value>) -> Option<Bytes> {
    let mut object: Map<String, Value> = serde_json::from_slice(body).ok()?;
    drop_own(&mut object);
    object.extend(named);
    serde_json::to_vec(&object).ok().map(Bytes::from)
}

/// [`without_own_params`] when `fleet` disaggregates (for a request no plan was made for).
pub fn without_own_params_if_split(fleet: &crate::fleet::Fleet, body: Bytes) -> Bytes {
    if disaggregates(&fleet.members()) { without_own_params(&body) } else { body }
}

/// The fields that tell a replica how a prefill is handed over: vLLM's params, SGLang's room
/// (and SGLang's other fields of it, which the router does not set).
const OWN_FIELDS: [&str; 7] = [
    "kv_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "disagg_prefill_dp_rank",
];

/// `object` without [`OWN_FIELDS`] (every spelling of them: an escaped key reads the same in
/// Python).
fn drop_own(object: &mut Map<String, Value>) {
    for key in OWN_FIELDS {
        object.remove(key);
    }
}

/// The client's `body` without [`OWN_FIELDS`] of its own: in a fleet that disaggregates, they
/// would make a replica pull from, or hold blocks for, whatever they name. Whatever the
/// endpoint: vLLM's Messages API passes `kv_transfer_params` on to the chat it makes, and a
/// replica that reads none of them loses nothing.
fn without_own_params(body: &Bytes) -> Bytes {
    let named = parse_object(body, &OWN_FIELDS).is_ok_and(|fields| fields.iter().any(Option::is_some));
    if !named {
        return body.clone();
    }
    match serde_json::from_slice::<Map<String, Value>>(body) {
        Ok(mut object) => {
            drop_own(&mut object);
            serde_json::to_vec(&object).map_or_else(|_| body.clone(), Bytes::from)
        }
        Err(_) => body.clone(),
    }
}

#[cfg(test)]
mod tests {
    /// A room on a data-parallel prefill replica's rank is one SGLang reads that rank from.
    #[test]
    fn a_bootstrap_room_names_the_prefill_rank() {
        for random in [0, 1, 7, u64::MAX, u64::MAX - 5, 0x1234_5678_9abc_def0] {
            assert!(super::bootstrap_room(random, None) <= i64::MAX as u64);
            assert!(super::bootstrap_room(random, Some((0, 1))) <= i64::MAX as u64);
            for (rank, ranks) in [(0, 2), (1, 2), (2, 3), (5, 8)] {
                let room = super::bootstrap_room(random, Some((rank, ranks)));
                assert_eq!(room % u64::from(ranks), u64::from(rank), "{random} {rank}/{ranks}");
                assert!(room <= i64::MAX as u64);
            }
        }
    }

    use super::*;

    fn object(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    fn prefill_of(body: &[u8]) -> Option<Bytes> {
        prefillable(Endpoint::Completions, body)
            .and_then(|object| for_prefill(Endpoint::Completions, object, remote_decode()))
    }

    #[test]
    fn the_prefill_asks_one_token_whole_and_a_remote_decode() {
        let client = br#"{"model":"m","prompt":"hi","max_tokens":64,"stream":true,"stream_options":{"include_usage":true},"min_tokens":8,"temperature":0.5}"#;
        let sent = object(&prefill_of(client).unwrap());
        assert_eq!(sent["max_tokens"], 1);
        assert_eq!(sent["stream"], false);
        assert_eq!(sent["temperature"], 0.5);
        assert_eq!(sent["prompt"], "hi");
        for gone in ["stream_options", "min_tokens", "max_completion_tokens"] {
            assert!(sent.get(gone).is_none(), "{gone}");
        }
        assert_eq!(sent["kv_transfer_params"]["do_remote_decode"], true);
        let chat = br#"{"messages":[],"max_completion_tokens":9,"max_tokens":9}"#;
        let sent = object(&prefill_of(chat).unwrap());
        assert_eq!((sent["max_completion_tokens"].as_u64(), sent["max_tokens"].as_u64()), (Some(1), Some(1)));
        assert!(prefill_of(b"[1]").is_none());
        // Its one token's logprobs are nobody's; the prompt's only a replica that computed it has.
        let logprobs = object(&prefill_of(br#"{"prompt":"hi","logprobs":5,"echo":false}"#).unwrap());
        assert!(logprobs.get("logprobs").is_none() && logprobs.get("echo").is_none(), "{logprobs}");
        assert!(prefill_of(br#"{"prompt":"hi","logprobs":1,"echo":true}"#).is_none());
        assert!(prefill_of(br#"{"prompt":"hi","prompt_logprobs":0}"#).is_none());
        assert!(prefill_of(br#"{"prompt":"hi","prompt_logprobs":null,"echo":true}"#).is_some());
    }

    #[test]
    fn several_prompts_are_split_through_rooms_only_and_several_choices_never() {
        let shape =
            |prompts, choices| Shape { endpoint: Endpoint::Completions, prompts, choices, unhashed: false };
        assert!(!shape(1, 1).whole(false) && !shape(1, 1).whole(true));
        assert!(shape(2, 1).whole(false) && !shape(2, 1).whole(true), "a room a prompt");
        assert!(shape(1, 2).whole(false) && shape(1, 2).whole(true), "choices share a room in SGLang");
        assert!(Shape { endpoint: Endpoint::Messages, ..shape(1, 1) }.whole(true));
        assert!(Shape { unhashed: true, ..shape(1, 1) }.whole(true));
        let logprobs = br#"{"prompt":"hi","echo":true,"logprobs":0}"#;
        assert!(shape(1, 1).goes_without_a_room(logprobs) && !shape(1, 1).goes_without_a_room(b"{}"));
    }

    #[test]
    fn the_bootstrap_host_is_the_prefill_replicas_url_host() {
        assert_eq!(host("http://10.0.0.7:30000"), "10.0.0.7");
        assert_eq!(host("https://user:pw@prefill-0.svc:30000/base?x=1"), "prefill-0.svc");
        assert_eq!(host("http://[fd00::7]:30000"), "[fd00::7]");
        assert_eq!(host("prefill-0"), "prefill-0");
    }

    #[test]
    fn a_decode_retry_goes_where_the_prefill_can_be_taken_over() {
        use crate::replicas::{EngineKind, ReplicaSpec, Replicas, Role};
        let replicas = Replicas::new();
        let add = |name: &str, engine, role| {
            let spec = ReplicaSpec { role, ..ReplicaSpec::new(name, "", engine, "m") };
            replicas.insert(ReplicaSpec { http_url: format!("http://{name}:8000"), ..spec }).unwrap()
        };
        let prefill = add("p", EngineKind::Sglang, Role::Prefill);
        let decode = add("d", EngineKind::Sglang, Role::Decode);
        let both = add("b", EngineKind::Sglang, Role::Both);
        let vllm = add("v", EngineKind::Vllm, Role::Decode);
        let remote = |bootstrap| Remote {
            id: Some(prefill.id),
            replica: None,
            predicted: None,
            cached: None,
            bootstrap,
            alone: None,
        };
        let takes = |remote: &Remote| [&prefill, &decode, &both, &vllm].map(|r| remote.decodable_on(r));
        // A decode after a bootstrap room is not retried: its room may have been taken.
        assert_eq!(takes(&remote(true)), [false; 4]);
        // Nor does an SGLang decode replica take one without a room.
        assert_eq!(takes(&remote(false)), [false, false, true, true]);
    }

    #[test]
    fn a_clients_own_params_are_dropped_where_replicas_read_them() {
        let own =
            Bytes::from_static(br#"{"prompt":"hi","kv\u005ftransfer_params":{"do_remote_decode":true}}"#);
        let sent = object(&without_own_params(&own));
        assert_eq!(sent, json!({"prompt": "hi"}));
        // vLLM's Messages API passes them on to the chat it makes.
        let message = br#"{"messages":[],"max_tokens":1,"kv_transfer_params":{"do_remote_prefill":true}}"#;
        let sent = object(&without_own_params(&Bytes::from_static(message)));
        assert_eq!(sent, json!({"messages": [], "max_tokens": 1}));
        let none = Bytes::from_static(br#"{"prompt":"hi","kv_transfer_params":null}"#);
        assert_eq!(without_own_params(&none), none, "null asks nothing");
        // A room of its own would have an SGLang decode replica pull from its host.
        let room = br#"{"prompt":"hi","bootstrap_host":"evil","bootstrap_port":1,"bootstrap\u005froom":7}"#;
        let sent = object(&without_own_params(&Bytes::from_static(room)));
        assert_eq!(sent, json!({"prompt": "hi"}));
        let named = fields([("bootstrap_host", json!("p0")), ("bootstrap_room", json!(9))]);
        let sent = object(&with_fields(room, named).unwrap());
        assert_eq!(
            sent,
            json!({"prompt": "hi", "bootstrap_host": "p0", "bootstrap_room": 9}),
            "the router's only"
        );
        // SGLang's `/generate` reads them, and the rest of its hand-over's.
        let native =
            br#"{"text":"hi","bootstrap_room":7,"disagg_prefill_dp_rank":3,"bootstrap_pair_key":"k"}"#;
        let sent = object(&without_own_params(&Bytes::from_static(native)));
        assert_eq!(sent, json!({"text": "hi"}));
    }

    #[test]
    fn a_generate_prefill_asks_one_token_whole_and_none_of_the_prompts_logprobs_is_split() {
        let body = br#"{"text":"hi","stream":true,"return_logprob":true,
            "sampling_params":[{"max_new_tokens":9,"min_new_tokens":4},null]}"#;
        let object = prefillable(Endpoint::Generate, body).expect("the output's logprobs only");
        let named = fields([("bootstrap_room", json!(9))]);
        let sent = serde_json::from_slice::<Value>(&for_prefill(Endpoint::Generate, object, named).unwrap());
        let expected = json!({
            "text": "hi", "stream": false, "bootstrap_room": 9,
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 1}],
        });
        assert_eq!(sent.unwrap(), expected);
        for asks in [
            br#"{"text":"hi","return_logprob":true,"logprob_start_len":0}"#.as_slice(),
            br#"{"text":["a","b"],"return_logprob":[false,true],"logprob_start_len":[-1,2]}"#,
            br#"{"text":"hi","return_logprob":"yes","logprob_start_len":[5]}"#,
        ] {
            assert!(prefillable(Endpoint::Generate, asks).is_none(), "{}", String::from_utf8_lossy(asks));
        }
        let output_only = br#"{"text":["a","b"],"return_logprob":[true,true],"logprob_start_len":[-1,-1]}"#;
        assert!(prefillable(Endpoint::Generate, output_only).is_some());
    }

    #[test]
    fn the_decode_gets_the_clients_body_and_the_prefills_params() {
        let client = br#"{"prompt":"hi","max_tokens":64,"stream":true,"kv_transfer_params":{"spoofed":1}}"#;
        let params = json!({"do_remote_prefill": true, "remote_block_ids": [0, 1]});
        let sent = object(&with_fields(client, fields([("kv_transfer_params", params.clone())])).unwrap());
        assert_eq!(sent["kv_transfer_params"], params);
        assert_eq!((sent["max_tokens"].as_u64(), sent["stream"].as_bool()), (Some(64), Some(true)));
    }
}
