//! Forwarding a request to a replica and its response back, faithfully: the original bytes
//! go upstream unchanged (only hop-by-hop headers are dropped), the response streams back
//! frame by frame.
//!
//! Retries: when a replica refuses the connection, fails before any response byte (a
//! malformed response head counts as an answer: never retried), or answers 503 (it refused to start the request: shutting down or its queue is full), the
//! request goes to the best replica of the plan not yet tried that has room (at most
//! [`MAX_ATTEMPTS`] in all; one passed over for want of room may have it now) — never
//! after a response has started, and never after a first-byte timeout (the replica may still
//! be working on it). Each failure counts toward the replica's outlier ejection; 5xx answers
//! are passed to the client and counted too (503 excepted: see [`super::upstream`]). When the
//! replicas left to retry on are all at `--max-in-flight-per-replica`, a retry (after a failure
//! or a 503) waits in line for room on one of them ([`super::queue`]). A retry is scored on
//! the index, credits and load as they are when it is sent ([`Decider::rescore`]).
//! A request sent on its own ([`to_replica`]: passed through, its body streamed) goes on to
//! the next replica only when no connection to one can be made: past that, its body may be
//! partly read.
//!
//! A request holds its [`Slot`] under `--max-in-flight` until its response body ends, streams
//! included.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, Uri, uri};
use http_body_util::BodyExt;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::access;
use super::background::{Backgrounds, Places};
use super::body::{BoxError, End, Hooks, ProxyBody, Tracked, Usage};
use super::disagg::Remote;
use super::error::{Client, ProxyError};
use super::http1::{Outgoing, UpstreamBody, WireError};
use super::live::Live;
use super::pool::{Pool, SendError, Unsent};
use super::queue::{Line, Queue};
use super::responses::{Keeps, Learner, Owner, Owners};
use super::route::{Decider, Hop, Plan, Scored};
use super::stalls::StallWatch;
use super::upload::{self, Progress};
use super::upstream::{LoadGuard, Upstream};
use crate::index::CreditHold;
use crate::metrics::ProxyMetrics;
use crate::replicas::Replica;
use kvroute_proto::ReplicaId;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Most replicas one request is tried on.
pub const MAX_ATTEMPTS: usize = 3;

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1; and
/// `proxy-connection`, which older clients send in its place), plus `host`, which the client
/// sets for the replica.
fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "proxy-connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
    )
}

/// The request id, on the request to the replica and on the response.
pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// The replica that answered.
pub const X_KVROUTE_REPLICA: HeaderName = HeaderName::from_static("x-kvroute-replica");
/// The prompt tokens the router expected the replica to have cached (after a remote prefill,
/// the prefill replica: [`super::disagg`]).
pub const X_KVROUTE_PREDICTED: HeaderName = HeaderName::from_static("x-kvroute-predicted-cached-tokens");

/// Timeouts, ejection settings and the body limit of the forwarder.
#[derive(Clone, Debug)]
pub struct ForwardConfig {
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    pub first_byte_timeout: Duration,
    /// The first-byte timeout of a prefill sent ahead of its request ([`super::disagg`]).
    pub prefill_timeout: Duration,
    /// The wait for an answer that is not a generation's (`--control-timeout-ms`).
    pub control_timeout: Duration,
    pub idle_timeout: Duration,
    /// Cuts HTTP/2 responses whose stream had no window for the send timeout.
    pub stalls: Arc<StallWatch>,
    pub eject_after: u32,
    pub ejection: Duration,
    /// Log each request when its response ends ([`super::access`]).
    pub access_log: bool,
    /// Add the client to `X-Forwarded-For` (`--forwarded-for`).
    pub forwarded_for: bool,
    /// `--replica-api-key`'s `Authorization`, sent in place of the client's (a reload changes
    /// it).
    pub replica_authorization: Live<Option<HeaderValue>>,
    /// Which replica stored each Responses API response ([`super::responses`]).
    pub owners: Arc<Owners>,
    /// Background responses' places, held until they are final ([`super::background`]).
    pub backgrounds: Arc<Backgrounds>,
    /// Fires at the drain timeout after a shutdown: open streams end with an error event.
    pub ending: CancellationToken,
}

/// Removes hop-by-hop headers, including any present that `Connection` names: one pass over
/// the names present, then a removal for each one found. `host` (every request) and
/// `connection` (most responses) are removed without collecting their names first.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let (mut host, mut connection) = (false, false);
    let mut doomed: Vec<HeaderName> = Vec::new();
    for name in headers.keys() {
        if name == header::HOST {
            host = true;
        } else if name == header::CONNECTION {
            connection = true;
        } else if is_hop_by_hop(name) {
            doomed.push(name.clone());
        }
    }
    if connection {
        // `keep-alive` is hop-by-hop anyway; other options name a field only when present.
        doomed.extend(
            super::http1::connection_options(headers)
                .filter(|name| !name.eq_ignore_ascii_case(b"keep-alive"))
                .filter_map(|name| HeaderName::from_bytes(name).ok())
                .filter(|name| headers.contains_key(name)),
        );
        headers.remove(header::CONNECTION);
    }
    if host {
        headers.remove(header::HOST);
    }
    for name in doomed {
        headers.remove(name);
    }
}

/// Sends a routed request (buffered body, so it can be retried) along `plan.order`; a retry
/// is scored again and takes the decision's credit along to the replica it goes to. When the replicas left to
/// retry on are all saturated, the retry waits in `line` for room on one of them (crediting
/// none while it waits).
pub async fn routed(
    pool: &Arc<Pool>,
    config: &ForwardConfig,
    decider: &Decider,
    plan: &mut Plan,
    (parts, mut body): (http::request::Parts, Bytes),
    admitted: Admitted<'_>,
    line: (&Queue, &Line),
) -> Result<Response<ProxyBody>, ProxyError> {
    let request_id = admitted.request_id;
    let metrics = &decider.metrics;
    let (client, headers) = upstream_head(parts, request_id, config);
    let client = client.keeping(plan.keeps_response, &headers);
    let mut last_error = None;
    // The replica of `plan.order` tried now, and those sent to so far (in `plan.order`).
    let (mut attempt, mut sent_to) = (0, Vec::with_capacity(MAX_ATTEMPTS));
    // Its load there: the decision counted it on its choice, and a retry's is counted as the
    // retry's replica is picked ([`next_attempt`]).
    let mut load = plan.load.take();
    loop {
        let member = plan.order().nth(attempt).map(|scored| scored.member.clone());
        let (Some(member), Some(mut guard)) = (member, load.take()) else { break };
        if !sent_to.is_empty() {
            metrics.retries.inc();
        }
        sent_to.push(attempt);
        let tried = sent_to.len();
        let upstream = &member.upstream;
        // A data-parallel replica's rank is named (and was credited).
        let rank = guard.rank();
        let ranked = rank.map(|rank| with_rank(&headers, rank));
        let uri = replica_uri(&member.replica, &client.uri)?;
        let sent = Instant::now();
        let head = ranked.as_ref().unwrap_or(&headers);
        match first_byte(
            config,
            sent,
            pool.send_head(&client.method, &uri, head, Outgoing::Full(body.clone())),
            None,
        )
        .await
        {
            Ok(Ok(response))
                if response.status() == http::StatusCode::SERVICE_UNAVAILABLE
                    && tried < MAX_ATTEMPTS
                    && untried(plan, &sent_to).any(|(_, s)| {
                        retry_on(decider, (plan, after_prefill_alone(plan)), &s.member).may(line.0)
                    }) =>
            {
                // A 503 means the replica refused the request without starting it (shutting
                // down, queue full): another replica can take it, now or once it has room.
                // Overload is not an outlier: counted as a failure, a load spike would eject
                // the fleet replica by replica.
                tracing::info!(replica = %member.replica.spec.name, request_id, "replica refused with 503; retrying elsewhere");
                prefill_alone(plan, &mut body);
                // The client's answer if no replica is left to take it: a 503 as the replica's.
                last_error = Some(ProxyError::RefusedBusy { replica: member.replica.spec.name.clone() });
            }
            Ok(Ok(response)) => {
                // An error answer (a request the replica refused, or failed) cached nothing to
                // credit it with: its credit ends now, not after the TTL.
                if response.status().is_success() {
                    guard.keep_rank();
                } else {
                    decider.withdraw_credit(plan);
                    guard.withdraw_rank();
                }
                let line = config.access_log.then(|| {
                    Box::new(access::Line {
                        replica: member.replica.spec.name.clone(),
                        attempt: tried - 1,
                        model: plan.model.clone(),
                        prompt_tokens: Some(plan.prompt_tokens),
                        predicted_cached_tokens: Some(plan.predicted_cached_tokens(attempt)),
                        hop: super::disagg::hop(plan),
                        ..access::Line::new(&admitted, &client.method, &client.uri)
                    })
                });
                let predicted = plan.predicted_cached_tokens(attempt);
                // A chat with media counts in neither hit rate: its media's tokens are in
                // the replica's cached tokens, and in no prompt count of the router's. Nor does
                // a batch of prompts: its prediction is its first prompt's, the replica's usage
                // every prompt's. Nor do several choices (`n`): the prediction is the first's,
                // and the replica reports one whose prompt the first had just cached.
                // Nor one whose prefill went ahead: that answer was counted.
                // Nor a prefill sent ahead that failed: the decode's answer counts.
                let failed_prefill = plan.hop.is_prefill() && !response.status().is_success();
                let counted =
                    plan.counted && !failed_prefill && plan.unhashed_tokens.is_none() && plan.sequences <= 1;
                let sent = Attempt {
                    replica: &member.replica.spec.name,
                    guard,
                    sent,
                    whole: sent,
                    hold: plan.hold.take(),
                    predict: (member.replica.prediction.get())
                        .filter(|_| response.status().is_success())
                        .map(|prediction| (prediction.clone(), plan.all_blocks.clone())),
                    counted: counted
                        .then_some(Predicted { prompt_tokens: plan.prompt_tokens, cached_tokens: predicted }),
                    keeps_response: plan.keeps_response,
                    timed: !plan.hop.is_prefill(),
                };
                let mut response = wrap(response, &client, sent, config, metrics, admitted, line);
                let headers = response.headers_mut();
                if let Ok(v) = HeaderValue::from_str(&member.replica.spec.name) {
                    headers.insert(X_KVROUTE_REPLICA, v);
                }
                if let Some(rank) = rank {
                    headers.insert(X_KVROUTE_RANK, HeaderValue::from(rank));
                }
                headers.insert(X_KVROUTE_PREDICTED, HeaderValue::from(predicted));
                if let Some(remote) = &plan.prefilled_by {
                    remote.headers(headers);
                }
                if counted {
                    metrics.predicted_cached_tokens.inc_by(predicted);
                    metrics.prompt_tokens.inc_by(plan.prompt_tokens);
                }
                return Ok(response);
            }
            // The replica answered, malformed: it ran the request, which goes nowhere else.
            Ok(Err(e @ SendError::Wire(WireError::Malformed(_)))) => {
                tracing::warn!(replica = %member.replica.spec.name, error = %e, request_id, "replica answered with a malformed head");
                // It ran the request: its credits stand, on its rank as on it.
                guard.keep_rank();
                record_failure(upstream, config, metrics);
                return Err(ProxyError::Upstream {
                    replica: member.replica.spec.name.clone(),
                    reason: e.to_string(),
                });
            }
            Ok(Err(e)) => {
                tracing::warn!(replica = %member.replica.spec.name, error = %e, request_id, "replica failed before answering");
                if !e.sent_nothing() {
                    prefill_alone(plan, &mut body);
                }
                record_failure(upstream, config, metrics);
                last_error = Some(ProxyError::Upstream {
                    replica: member.replica.spec.name.clone(),
                    reason: e.to_string(),
                });
            }
            Err(_) => {
                // It may still run the request: its credits stand, on its rank as on it.
                guard.keep_rank();
                // A prefill through a bootstrap room answers once its decode replica took the
                // KV: its time is the decode replica's too, and is not held against it.
                if plan.hop != Hop::Bootstrap {
                    record_failure(upstream, config, metrics);
                }
                return Err(ProxyError::Timeout {
                    replica: member.replica.spec.name.clone(),
                    timeout_ms: config.first_byte_timeout.as_millis() as u64,
                });
            }
        }
        // Failed here without starting: the replica holds no credit for it (nor while the
        // retry waits for room elsewhere, which would draw the prefix's next requests here),
        // nor its place. (After a first-byte timeout the replica may still run it: its credit
        // stands.)
        drop(guard);
        decider.withdraw_credit(plan);
        if tried == MAX_ATTEMPTS {
            break;
        }
        match next_attempt(decider, plan, &sent_to, line).await {
            Ok((next, next_load)) => (attempt, load) = (next, Some(next_load)),
            Err(waited) => {
                last_error = waited.or(last_error);
                break;
            }
        }
    }
    Err(last_error.unwrap_or_else(|| ProxyError::Unavailable("no eligible replica".into())))
}

/// The data-parallel rank of the replica that served the request, when the router named one.
pub const X_KVROUTE_RANK: HeaderName = HeaderName::from_static("x-kvroute-rank");

/// Names the data-parallel rank a request goes to, as vLLM and SGLang read it.
pub const X_DATA_PARALLEL_RANK: HeaderName = HeaderName::from_static("x-data-parallel-rank");

/// `headers` naming data-parallel rank `rank` ([`crate::index::Ranks`]).
fn with_rank(headers: &HeaderMap, rank: u32) -> HeaderMap {
    let mut named = headers.clone();
    named.insert(X_DATA_PARALLEL_RANK, HeaderValue::from(rank));
    named
}

/// Whether a candidate may take a retry ([`retry_on`]).
#[derive(Debug, PartialEq, Eq)]
enum Retry {
    Takes,
    /// It would, but it is at `--max-in-flight-per-replica`.
    Saturated,
    Not,
}

impl Retry {
    /// Whether the retry may go to it, now or (when `queue` lets requests wait) once it has
    /// room.
    fn may(&self, queue: &Queue) -> bool {
        match self {
            Retry::Takes => true,
            Retry::Saturated => queue.waits(),
            Retry::Not => false,
        }
    }
}

/// Whether `member`, a candidate when its request was decided, is out of the running for a
/// later attempt: the fleet no longer has it (removed, or replaced by a replica of the same
/// name at another address, whose id it shares), it is draining or out of service since, or
/// it is unhealthy or ejected since while another of `peers` (the request's other
/// candidates: those with its adapter) is up (with none up, those are tried, as a decision
/// tries them).
pub(super) fn gone_since<'a>(
    fleet: &crate::fleet::Fleet,
    member: &crate::fleet::Member,
    peers: impl IntoIterator<Item = &'a crate::fleet::Member>,
) -> bool {
    let upstream = &member.upstream;
    let others_up = || {
        peers
            .into_iter()
            .any(|m| !Arc::ptr_eq(&m.upstream, upstream) && m.upstream.eligibility(u32::MAX).is_ok())
    };
    !fleet.still_has(member)
        || upstream.is_draining()
        || !upstream.is_serving()
        || (!upstream.is_healthy() && others_up())
}

/// A decode sent with a remote prefill's params, whose replica failed once it may have had
/// it, is retried with the client's body, to be prefilled where it goes: that replica may
/// have pulled the prefill's KV, and the prefill replica then freed those blocks, which
/// another replica pulling them would read as whatever holds them now.
fn prefill_alone(plan: &mut Plan, body: &mut Bytes) {
    if let Some(alone) = plan.prefilled_by.as_ref().and_then(|remote| remote.alone.clone()) {
        *body = alone;
        plan.prefilled_by = None;
    }
}

/// The remote prefill `plan`'s retry goes with after [`prefill_alone`]: none, where it can go
/// without (the replica that prefilled it may then decode it too, a `both` one).
fn after_prefill_alone(plan: &Plan) -> Option<&Remote> {
    plan.prefilled_by.as_ref().filter(|remote| remote.alone.is_none())
}

/// Whether `member`, a candidate when the request was decided, may take its retry: it is not
/// [`gone_since`], nor at `--max-in-flight-per-replica` since (when a whole fleet refuses at
/// once, overloaded, the retries would go on past the limit: it may take the retry once it
/// has room).
fn retry_on(
    decider: &Decider,
    (plan, prefilled_by): (&Plan, Option<&Remote>),
    member: &crate::fleet::Member,
) -> Retry {
    // The replica a decode's params name (`prefilled_by`'s), and that prefilled it, does not
    // decode it; nor does one that would not wait for its bootstrap room; nor does an SGLang
    // decode replica take what comes without one.
    let undecodable = match prefilled_by {
        Some(remote) => !remote.decodable_on(&member.replica),
        None => member.replica.spec.waits_for_a_room(),
    };
    if undecodable || gone_since(&decider.fleet, member, plan.order().map(|s| &s.member)) {
        Retry::Not
    } else if !member.upstream.has_room(decider.max_in_flight_per_replica()) {
        Retry::Saturated
    } else {
        Retry::Takes
    }
}

/// The candidates of `plan`'s order not yet sent to (`sent_to`), as their places in it.
fn untried<'a>(plan: &'a Plan, sent_to: &'a [usize]) -> impl Iterator<Item = (usize, &'a Scored)> {
    plan.order().enumerate().filter(|(i, _)| !sent_to.contains(i))
}

/// The first of `candidates` (their places in a plan's order, whether they take a retry, and
/// their ids) that takes a retry, and what `take` makes of it (its load there; `None` when
/// another request took its last room since, and it counts as saturated); else those of them
/// that would once they have room.
fn first_to_take<T>(
    candidates: impl Iterator<Item = (usize, Retry, ReplicaId)>,
    mut take: impl FnMut(usize) -> Option<T>,
) -> Result<(usize, T), Vec<ReplicaId>> {
    let mut saturated = Vec::new();
    for (i, retry, id) in candidates {
        match retry {
            Retry::Takes => match take(i) {
                Some(taken) => return Ok((i, taken)),
                None => saturated.push(id),
            },
            Retry::Saturated => saturated.push(id),
            Retry::Not => {}
        }
    }
    Err(saturated)
}

/// The candidate of `plan` to retry on, none of `sent_to`, and the retry's load there
/// ([`Decider::retry`]: taken as it is picked, so that a woken retry takes the room that woke
/// it): the best of the rest that may take it ([`retry_on`]; one passed over for want of
/// room may have it now), waiting in `line` for room on them when they are all saturated
/// ([`super::queue`]). `Err(None)`: none is left, or the line is off (the last error stands);
/// `Err(Some)`: the wait's 503 (its time is up, or the line is full).
async fn next_attempt(
    decider: &Decider,
    plan: &mut Plan,
    sent_to: &[usize],
    (queue, line): (&Queue, &Line),
) -> Result<(usize, LoadGuard), Option<ProxyError>> {
    let mut next = || {
        let candidates: Vec<_> = untried(plan, sent_to)
            .map(|(i, scored)| {
                (
                    i,
                    retry_on(decider, (plan, plan.prefilled_by.as_ref()), &scored.member),
                    scored.member.replica.id,
                )
            })
            .collect();
        let taken = first_to_take(candidates.into_iter(), |i| decider.retry(plan, i));
        taken.map_err(|saturated| match saturated.is_empty() {
            true => ProxyError::Unavailable("no replica left to retry on".into()),
            false => ProxyError::Saturated {
                reason: "every replica left to retry on is saturated".into(),
                replicas: saturated,
            },
        })
    };
    if !queue.waits() {
        return next().map_err(|_| None);
    }
    let goes_to = |(_, load): &(usize, LoadGuard)| Some(load.upstream().id());
    let waiters = decider.fleet.waiters();
    match queue.until_room(waiters, (line, &decider.metrics), || std::future::ready(next()), goes_to).await {
        Ok(next) => Ok(next),
        Err(ProxyError::Unavailable(_)) => Err(None),
        Err(waited) => Err(Some(waited)),
    }
}

/// A request's body for [`to_replica`], and the load it brings the replica.
pub struct Sending {
    /// In hand (sent with `Content-Length`, on a pooled connection) or streamed through.
    pub body: Outgoing,
    /// A streamed body's progress (the first-byte timeout waits for the upload).
    pub uploaded: Option<Progress>,
    /// The sequences it runs (its `n`).
    pub sequences: u32,
    /// Prompt tokens, and those of them the replica is to prefill (0 when not known).
    pub prompt_tokens: u64,
    pub prefill_tokens: u64,
    /// What a Responses request's replica keeps of its answer.
    pub keeps_response: Keeps,
    /// The data-parallel rank to send it to (a continuation's, which holds its conversation).
    pub rank: Option<u32>,
}

impl Sending {
    /// A body that streams through, its load not known.
    pub fn streamed(body: ProxyBody, uploaded: Progress) -> Self {
        Sending {
            body: Outgoing::Stream(body),
            uploaded: Some(uploaded),
            sequences: 1,
            prompt_tokens: 0,
            prefill_tokens: 0,
            keeps_response: Keeps::Nothing,
            rank: None,
        }
    }
}

/// Sends a request to the first of `members` (at most [`MAX_ATTEMPTS`] of them), and to
/// the next while no connection to one can be made (none has read the request, but the one
/// whose pooled connection failed with it, [`SendError::Resent`]: its process ended as it
/// took it, or it had closed the connection as it went out).
pub async fn to_replica(
    pool: &Arc<Pool>,
    config: &ForwardConfig,
    decider: &Decider,
    members: &[crate::fleet::Member],
    parts: http::request::Parts,
    Sending { mut body, uploaded, sequences, prompt_tokens, prefill_tokens, keeps_response, rank }: Sending,
    admitted: Admitted<'_>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let (client, headers) = upstream_head(parts, admitted.request_id, config);
    let client = client.keeping(keeps_response, &headers);
    let metrics = &decider.metrics;
    let (mut attempt, mut last_error) = (0, None);
    for (i, member) in members.iter().enumerate() {
        let upstream = &member.upstream;
        // A later one gone since the replicas were chosen is passed over, as a routed
        // retry's is. (Not one at its in-flight limit: these requests' limit is soft. Their
        // replicas were chosen with room, and a request deciding meanwhile may take it.)
        if attempt > 0 && gone_since(&decider.fleet, member, members) {
            continue;
        }
        if attempt > 0 {
            metrics.retries.inc();
        }
        let more = attempt + 1 < MAX_ATTEMPTS && i + 1 < members.len();
        let mut guard = upstream.begin(sequences, prefill_tokens, prompt_tokens);
        // A rank named is counted in its load (the blocks are the stored conversation's, which
        // the router never saw).
        let ranked = rank.zip(member.replica.ranks.get()).map(|(rank, ranks)| {
            guard.hold_rank(ranks.begin(rank, sequences, (&[], 0, 0), prompt_tokens));
            with_rank(&headers, rank)
        });
        let uri = replica_uri(&member.replica, &client.uri)?;
        let sent = Instant::now();
        let exchange =
            pool.send_or_give_back(&client.method, &uri, ranked.as_ref().unwrap_or(&headers), body);
        let answer = match first_byte(config, sent, exchange, uploaded.as_ref()).await {
            Ok(Err(Unsent::NotConnected(e, back))) if more => {
                tracing::info!(replica = %member.replica.spec.name, error = %e, request_id = admitted.request_id, "no connection to the replica; trying the next");
                record_failure(upstream, config, metrics);
                let replica = member.replica.spec.name.clone();
                last_error = Some(ProxyError::Upstream { replica, reason: e.to_string() });
                (body, attempt) = (back, attempt + 1);
                continue;
            }
            answer => answer.map(|sent| sent.map_err(Unsent::into_error)),
        };
        let sending = (guard, &client, (sent, uploaded.as_ref()));
        return answered(
            answer,
            (member, attempt),
            sending,
            (prompt_tokens, keeps_response),
            (config, metrics),
            admitted,
        );
    }
    Err(last_error.unwrap_or_else(|| ProxyError::Unavailable("no healthy replica".into())))
}

/// [`to_replica`]'s outcome on `member`.
fn answered(
    answer: Result<Result<Response<UpstreamBody>, SendError>, tokio::time::error::Elapsed>,
    (member, attempt): (&crate::fleet::Member, usize),
    (guard, client, (sent, uploaded)): (LoadGuard, &ClientHead, (Instant, Option<&Progress>)),
    (prompt_tokens, keeps_response): (u64, Keeps),
    (config, metrics): (&ForwardConfig, &ProxyMetrics),
    admitted: Admitted<'_>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let upstream = &member.upstream;
    match answer {
        Ok(Ok(response)) => {
            // An upload the replica answered before its end is still going on.
            let whole = uploaded.as_ref().map_or(sent, |u| u.finished_at().unwrap_or_else(Instant::now));
            let ranked = guard.rank();
            let load = (guard, prompt_tokens, keeps_response);
            let mut response = passed_on(
                response,
                client,
                (member, attempt),
                (sent, whole),
                load,
                (config, metrics),
                admitted,
            );
            if let Some(rank) = ranked {
                response.headers_mut().insert(X_KVROUTE_RANK, HeaderValue::from(rank));
            }
            Ok(response)
        }
        // The client's body failed (too large, or the client went away): not the replica's fault.
        Ok(Err(SendError::Wire(WireError::RequestBody(e)))) => {
            Err(upload::client_error(&e, config.max_body_bytes))
        }
        Ok(Err(e)) => {
            record_failure(upstream, config, metrics);
            Err(ProxyError::Upstream { replica: member.replica.spec.name.clone(), reason: e.to_string() })
        }
        Err(_) => {
            record_failure(upstream, config, metrics);
            Err(ProxyError::Timeout {
                replica: member.replica.spec.name.clone(),
                timeout_ms: config.first_byte_timeout.as_millis() as u64,
            })
        }
    }
}

/// The answer to a request sent to `member` (its `attempt`th, from 0), not routed on a prompt
/// (its usage counts in neither hit rate), passed on: `sent` when it went out and `whole`
/// when the replica had all of it; the replica's load for it, its prompt tokens (0: not
/// known) and whether the replica may keep its response.
pub(super) fn passed_on(
    response: Response<UpstreamBody>,
    client: &ClientHead,
    (member, attempt): (&crate::fleet::Member, usize),
    (sent, whole): (Instant, Instant),
    (guard, prompt_tokens, keeps_response): (LoadGuard, u64, Keeps),
    (config, metrics): (&ForwardConfig, &ProxyMetrics),
    admitted: Admitted<'_>,
) -> Response<ProxyBody> {
    let line = config.access_log.then(|| {
        Box::new(access::Line {
            replica: member.replica.spec.name.clone(),
            attempt,
            prompt_tokens: (prompt_tokens > 0).then_some(prompt_tokens),
            ..access::Line::new(&admitted, &client.method, &client.uri)
        })
    });
    let replica = &member.replica.spec.name;
    let attempt = Attempt {
        replica,
        guard,
        sent,
        whole,
        hold: None,
        predict: None,
        counted: None,
        keeps_response,
        timed: true,
    };
    let mut response = wrap(response, client, attempt, config, metrics, admitted, line);
    if let Ok(v) = HeaderValue::from_str(replica) {
        response.headers_mut().insert(X_KVROUTE_REPLICA, v);
    }
    response
}

/// Sends a request (method, absolute URI, headers) with `body` and waits for its response
/// head until the first-byte timeout (counted from `sent`).
///
/// The exchange's future is boxed: it is about 2 KB, and unboxed it made every future that
/// awaits it (up to the one hyper keeps for each request) that much larger, all of it
/// copied each time one of them was made or moved (~3% of the proxy's user CPU a request).
///
/// For a streamed upload (`uploaded`), the timeout counts from when the upload went through
/// whole; while it is going, from when the replica last took some of it, and not at all
/// while the upload waits for the client (the client's silence is the upload's idle
/// timeout's: 408). So a slow upload waits, and a replica that stops reading one times out
/// like one that does not answer.
async fn first_byte<T>(
    config: &ForwardConfig,
    sent: Instant,
    exchange: impl Future<Output = T>,
    uploaded: Option<&Progress>,
) -> Result<T, tokio::time::error::Elapsed> {
    let mut exchange = Box::pin(exchange);
    let mut deadline = sent + config.first_byte_timeout;
    loop {
        let elapsed = match tokio::time::timeout_at(deadline, &mut exchange).await {
            Ok(answer) => return Ok(answer),
            Err(elapsed) => elapsed,
        };
        let Some(uploaded) = uploaded else { return Err(elapsed) };
        // While the upload waits for the client, the replica is not the one to time (the
        // upload's idle timeout is); otherwise the replica is taking it, or not.
        let since = match (uploaded.finished_at(), uploaded.waiting_on_client(), uploaded.read_at()) {
            (Some(finished), ..) => finished,
            (None, true, _) => Instant::now(),
            (None, false, Some(read)) => read,
            // The body was never asked for: the replica has not taken the head.
            (None, false, None) => sent,
        };
        match since + config.first_byte_timeout {
            later if later > deadline => deadline = later,
            _ => return Err(elapsed),
        }
    }
}

pub(super) fn record_failure(upstream: &Upstream, config: &ForwardConfig, metrics: &ProxyMetrics) {
    Judge::new(config, metrics).failure(upstream);
}

/// The client's request line and version, and the headers every attempt sends: the client's
/// without hop-by-hop ones (nor a data-parallel rank; `Accept-Encoding: identity`), the request
/// id, `--replica-api-key` in
/// place of the client's key on the paths the router guards ([`super::live::guarded`]), and
/// with `--forwarded-for` the client's address ([`forwarded`]).
/// Taken once per request, not per attempt.
pub(super) fn upstream_head(
    parts: http::request::Parts,
    request_id: &str,
    config: &ForwardConfig,
) -> (ClientHead, HeaderMap) {
    let http::request::Parts { method, uri, version, mut headers, extensions, .. } = parts;
    strip_hop_by_hop(&mut headers);
    // Only where the router's keys guard: an engine's own path outside `/v1` (SGLang's
    // `/flush_cache`, say) is the engine's to guard, with the client's own credentials.
    if super::live::guarded(&method, uri.path())
        && let Some(authorization) = &*config.replica_authorization.get()
    {
        headers.insert(header::AUTHORIZATION, authorization.clone());
    }
    // The rank is the router's to name, on the replica it chose: a client's would name a
    // rank of whichever replica the request reaches (a 400 where it has fewer).
    headers.remove(X_DATA_PARALLEL_RANK);
    // The router reads the answers it forwards (usage, a stored response's id, an SSE
    // stream's end) and writes its in-band errors into streams: a replica (or a gateway in
    // front of one) that compressed them, for a client's `gzip`, would have them unread and
    // an error event written into gzip bytes. Answers come plain, as nginx's `sub_filter`
    // needs them.
    headers.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
    if let Ok(id) = HeaderValue::from_str(request_id) {
        headers.insert(X_REQUEST_ID, id);
    }
    if config.forwarded_for
        && let Some(peer) = extensions.get::<kvroute_proto::serve::Peer>()
    {
        let https = extensions.get::<kvroute_proto::serve::Https>().is_some();
        forwarded(&mut headers, peer.0.ip(), if https { "https" } else { "http" });
    }
    (ClientHead { method, uri, version, authorization: None }, headers)
}

/// Appends `client` to `X-Forwarded-For` (one field, the client's own list first, as nginx's
/// `$proxy_add_x_forwarded_for`; an IPv4 client of a dual-stack listener as IPv4), and sets
/// `X-Forwarded-Proto` to the scheme the client used, `http` or `https` (`--tls-cert`), as
/// nginx's `$scheme` (a client's own would be believed by a replica that trusts the router).
fn forwarded(headers: &mut HeaderMap, client: std::net::IpAddr, scheme: &'static str) {
    const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
    const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
    let mut list = Vec::new();
    for (i, value) in headers.get_all(&X_FORWARDED_FOR).iter().enumerate() {
        if i > 0 {
            list.extend_from_slice(b", ");
        }
        list.extend_from_slice(value.as_bytes());
    }
    if !list.is_empty() {
        list.extend_from_slice(b", ");
    }
    list.extend_from_slice(client.to_canonical().to_string().as_bytes());
    if let Ok(value) = HeaderValue::from_bytes(&list) {
        headers.insert(X_FORWARDED_FOR, value);
    }
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(scheme));
}

/// What a forwarded request keeps of the client's request line.
pub(super) struct ClientHead {
    pub(super) method: Method,
    pub(super) uri: Uri,
    version: http::Version,
    /// For a Responses request generated in the background, the `Authorization` it went to
    /// its replica with: the replica is asked with it how the response stands.
    authorization: Option<HeaderValue>,
}

impl ClientHead {
    /// Keeps the `Authorization` of `headers` (the request's, as sent) if `keeps` is a
    /// background response's.
    fn keeping(mut self, keeps: Keeps, headers: &HeaderMap) -> Self {
        if keeps == Keeps::Background {
            self.authorization = headers.get(header::AUTHORIZATION).cloned();
        }
        self
    }
}

/// The replica's URI for the client's: its base URL followed by the client's path and query.
pub(super) fn replica_uri(replica: &Replica, client: &Uri) -> Result<Uri, ProxyError> {
    let path = client.path_and_query();
    if let Some((scheme, authority)) = &replica.origin {
        let mut parts = uri::Parts::default();
        parts.scheme = Some(scheme.clone());
        parts.authority = Some(authority.clone());
        parts.path_and_query = Some(path.cloned().unwrap_or_else(|| uri::PathAndQuery::from_static("/")));
        return Uri::from_parts(parts).map_err(|e| ProxyError::Unavailable(format!("bad replica URL: {e}")));
    }
    let (base, path) = (&replica.spec.http_url, path.map_or("/", |p| p.as_str()));
    let mut url = String::with_capacity(base.len() + path.len());
    url.push_str(base);
    url.push_str(path);
    Uri::try_from(url).map_err(|e| ProxyError::Unavailable(format!("bad replica URL {base:?}: {e}")))
}

/// What a response takes over from the attempt that got it: the replica's load, when the
/// request went out, the decision's credit hold, and whether its cached tokens count in the
/// hit rates.
struct Attempt<'a> {
    /// The replica's name.
    replica: &'a str,
    guard: LoadGuard,
    sent: Instant,
    /// When the replica had the whole request: `sent`, or a streamed upload's end (what the
    /// first-byte timeout counts from).
    whole: Instant,
    hold: Option<CreditHold>,
    /// Of a replica without events answering with success: its predicted cache, which holds
    /// the request's blocks from the answer's first data on.
    predict: Option<Predict>,
    /// What the router predicted of a routed request whose tokens it knew.
    counted: Option<Predicted>,
    /// What the replica keeps of the answer.
    keeps_response: Keeps,
    /// Whether its times count in the upstream histograms: not a prefill sent ahead, whose
    /// request's decode is timed (one sample a request).
    timed: bool,
}

/// A replica's predicted cache, and the blocks of the prompts it was sent.
type Predict = (Arc<crate::ingest::Prediction>, Arc<[kvroute_proto::BlockHash]>);

/// A routed request's prompt tokens and the cached tokens the router predicted for it.
#[derive(Clone, Copy, Debug)]
struct Predicted {
    prompt_tokens: u64,
    cached_tokens: u64,
}

/// The upstream response, with the body tracked and hop-by-hop headers removed.
fn wrap(
    response: Response<UpstreamBody>,
    client: &ClientHead,
    Attempt { replica, guard, sent, whole, hold, predict, counted, keeps_response, timed }: Attempt<'_>,
    config: &ForwardConfig,
    metrics: &ProxyMetrics,
    admitted: Admitted<'_>,
    mut access: Option<Box<access::Line>>,
) -> Response<ProxyBody> {
    let status = response.status();
    if let Some(line) = &mut access {
        line.status = status.as_u16();
    }
    let ranked = guard.rank();
    let empty = http_body::Body::is_end_stream(response.body());
    // A 5xx head is a failure at once; a 503 (a refusal: overload) is nothing either way;
    // any other answer is judged by how its body ends.
    let judge = if status == http::StatusCode::SERVICE_UNAVAILABLE {
        None
    } else if status.is_server_error() {
        record_failure(guard.upstream(), config, metrics);
        None
    } else if empty {
        // Nothing will be read of an empty body (`Content-Length: 0`, 204): whole already.
        guard.upstream().record_success();
        None
    } else {
        Some(Judge::new(config, metrics))
    };
    let (mut parts, body) = response.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    if let Ok(id) = HeaderValue::from_str(admitted.request_id) {
        parts.headers.insert(X_REQUEST_ID, id);
    }
    let sse = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.get(.."text/event-stream".len()))
        .is_some_and(|v| v.eq_ignore_ascii_case("text/event-stream"));
    if sse {
        // A stream may end with an error event of the router's: framed by its replica's
        // length, the event would be cut to what the length had left.
        parts.headers.remove(header::CONTENT_LENGTH);
    }
    let hooks = Box::new(ResponseHooks {
        guard,
        slot: admitted.slot,
        judge,
        reported: counted.map(|predicted| (predicted, metrics.reported.clone())),
        upstream_seconds: timed
            .then(|| (metrics.upstream_ttfb_seconds.clone(), metrics.upstream_duration_seconds.clone())),
        sent,
        dialect: super::upstream::usage_dialect(client.uri.path()),
        access,
        hold,
        predict,
        learner: (status.is_success() && keeps_response.any())
            .then(|| Learner::new(config.owners.clone(), Owner::new(replica, ranked))),
        background: (status.is_success() && keeps_response == Keeps::Background).then(|| {
            Box::new(Background {
                backgrounds: config.backgrounds.clone(),
                authorization: client.authorization.clone(),
                streams: sse,
                learned: None,
            })
        }),
    });
    // A stream that fails ends with an error event in the envelope its client reads.
    let sse = sse.then(|| (Client::of_path(client.uri.path()), admitted.request_id));
    // The first event of a stream comes after the request's queueing and prefill: the
    // first-byte timeout's to bound, not the idle timeout's.
    // A Responses stream opens with events sent before the engine's first output: a new
    // response's, and a background one's resumed (`GET /v1/responses/{id}?stream=true`).
    let opening = sse.is_some() && super::responses::target(client.uri.path()).is_some();
    let body = Tracked::new(body, config.idle_timeout, hooks)
        .first_by(whole + config.first_byte_timeout)
        .sse(sse)
        .ending(sse.map(|_| &config.ending))
        .opening(opening)
        .empty(empty);
    // An HTTP/1 client that stops reading is the server's send timeout's (its connection's
    // writes wait); an HTTP/2 stream without window is the stall watch's.
    let body =
        if client.version == http::Version::HTTP_2 { body.watched(config.stalls.clone()) } else { body };
    let body = body.map_err(|e: BoxError| e).boxed_unsync();
    Response::from_parts(parts, body)
}

/// Releases a request's load and records what its response showed.
struct ResponseHooks {
    guard: LoadGuard,
    /// Released with the hooks, when the body ends (or held with the load of a response
    /// generated in the background: [`Background`]).
    slot: Option<Slot>,
    /// Passive health: whether the body's end counts for or against the replica.
    judge: Option<Judge>,
    /// Where the cached tokens the response reports count, beside what was predicted of the
    /// same request (not for a chat with media).
    reported: Option<(Predicted, Arc<crate::metrics::Reported>)>,
    /// Time to the first byte and in all, unless it is a prefill sent ahead.
    upstream_seconds: Option<(Histogram, Histogram)>,
    sent: Instant,
    /// Which API's usage its answer carries ([`super::upstream::usage_dialect`]).
    dialect: usize,
    /// The access log's line, when it is on.
    access: Option<Box<access::Line>>,
    /// The decision's pinned credits: let go at the first data (the prefill is done, the
    /// replica's events follow), or when the body ends without any.
    hold: Option<CreditHold>,
    /// Recorded at the first data: the replica has the prompt's blocks then.
    predict: Option<Predict>,
    /// For a Responses API answer: learns which replica stored it.
    learner: Option<Learner>,
    /// For a response generated in the background: its places are held after the body ends.
    background: Option<Box<Background>>,
}

/// A response generated in the background ([`super::background`]): once its answer ends, the
/// request's load and places are held until its replica shows it final.
struct Background {
    backgrounds: Arc<Backgrounds>,
    /// What its replica is asked with.
    authorization: Option<HeaderValue>,
    /// Whether the answer streams: a stream read to its end ended with the response.
    streams: bool,
    /// Its id and the replica that has it, once the answer showed them.
    learned: Option<(Box<str>, Arc<str>)>,
}

impl ResponseHooks {
    /// Ends the request's credits on its replica, and on its rank of a data-parallel one
    /// (credited there though the replica's stream is FALLBACK, a rank unfollowed).
    fn withdraw_credits(&mut self) {
        if let Some(hold) = self.hold.take() {
            hold.withdraw_own();
        }
        self.guard.withdraw_rank();
    }
}

impl Hooks for ResponseHooks {
    fn watch(&mut self, data: &[u8]) -> bool {
        let Some(learner) = self.learner.as_mut() else { return false };
        if learner.feed(data) {
            return true;
        }
        if let (Some(background), Some((id, replica))) = (self.background.as_mut(), learner.learned()) {
            background.learned = Some((id.into(), replica.clone()));
        }
        self.learner = None;
        false
    }

    fn first_data(&mut self, data: &[u8]) {
        // A stream that fails before its output stopped, or never ran: its credits end now
        // (as an error status's do), not after the TTL.
        let failed = super::opening::fails_in_band(data);
        if failed {
            self.withdraw_credits();
        }
        self.guard.prefill_done();
        if let Some((prediction, blocks)) = self.predict.take()
            && !failed
        {
            prediction.record(&blocks);
        }
        drop(self.hold.take());
        let now = Instant::now();
        if let Some((ttfb, _)) = &self.upstream_seconds {
            ttfb.observe(now.duration_since(self.sent).as_secs_f64());
        }
        if let Some(line) = &mut self.access {
            line.first_data = Some(now);
        }
    }

    fn finish(mut self: Box<Self>, end: End, usage: Usage) {
        // Given up before its first output (its client left, or an SGLang prefill failed
        // beside it): its replica drops it, and stores no more of its prompt than its events
        // show. Its credit ends now, not after the TTL.
        // (Once its first output came, they are no longer held: nothing to withdraw.)
        if end == End::Abandoned {
            self.withdraw_credits();
        }
        // A usage without cached tokens is a miss only in a whole answer: a stream cut off may
        // have shown its prompt's count (Anthropic's `message_start`, vLLM's continuous usage)
        // and not yet its cached tokens.
        let usage = Usage { counted: usage.counted && end == End::Complete, ..usage };
        let cached_tokens = self.guard.upstream().cached_tokens_in(usage, self.dialect);
        if let Some((_, duration)) = &self.upstream_seconds {
            duration.observe(self.sent.elapsed().as_secs_f64());
        }
        if let Some(line) = self.access.take() {
            line.finish(end, cached_tokens);
        }
        // Only answers that report their cached tokens (an error does not, nor a stream
        // without `stream_options.include_usage`) count on the realized side, so the two
        // hit rates compare the same requests.
        if let (Some(n), Some((predicted, reported))) = (cached_tokens, &self.reported) {
            reported.realized_cached_tokens.inc_by(n);
            reported.prompt_tokens.inc_by(predicted.prompt_tokens);
            reported.predicted_cached_tokens.inc_by(predicted.cached_tokens);
        }
        if let Some(judge) = &self.judge {
            let upstream = self.guard.upstream();
            match end {
                // Success only for a whole answer: a replica that sends its head and then
                // hangs (a wedged engine streaming) would otherwise clear its failures with
                // each new request, and never be ejected.
                End::Complete => upstream.record_success(),
                End::Failed => judge.failure(upstream),
                End::Abandoned => {}
            }
        }
        // A response generated in the background goes on after its answer, unless the answer
        // was its whole stream.
        let background = self.background.take().filter(|b| !(b.streams && end == End::Complete));
        if let Some(Background { backgrounds, authorization, learned, .. }) = background.map(|b| *b) {
            match learned {
                Some((id, replica)) => {
                    let ResponseHooks { guard, slot, .. } = *self;
                    backgrounds.hold(id, replica, authorization, Places { guard, slot });
                }
                None => backgrounds.unlearned(),
            }
        }
    }
}

/// A request the router took on: its id, its place under `--max-in-flight` (none for a
/// prefill sent ahead of its request: [`super::disagg`]), and when it arrived (known only
/// when the access log is on).
pub struct Admitted<'a> {
    pub request_id: &'a str,
    pub slot: Option<Slot>,
    pub received: Option<super::access::Arrival>,
}

/// A place under the router's in-flight limit, counted by its gauge while held, and its
/// request's key's place under `--max-in-flight-per-key`.
#[derive(Debug)]
pub struct Slot {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
    key: Option<super::per_key::KeyHold>,
}

impl Slot {
    /// A place under `limit`, if one is free.
    pub fn try_take(limit: &Arc<Semaphore>, gauge: &Gauge) -> Option<Slot> {
        let permit = limit.clone().try_acquire_owned().ok()?;
        Some(Slot::with(permit, gauge))
    }

    /// The place `permit` holds, counted in `gauge`.
    pub fn with(permit: OwnedSemaphorePermit, gauge: &Gauge) -> Slot {
        gauge.inc();
        Slot { _permit: permit, gauge: gauge.clone(), key: None }
    }

    /// Holds `key`'s place too, for as long as this place.
    pub fn hold_key(&mut self, key: Option<super::per_key::KeyHold>) {
        self.key = key;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// What passive health needs to count a failure (also when a response's body ends).
struct Judge {
    eject_after: u32,
    ejection: Duration,
    ejections: Counter,
}

impl Judge {
    fn new(config: &ForwardConfig, metrics: &ProxyMetrics) -> Self {
        Judge {
            eject_after: config.eject_after,
            ejection: config.ejection,
            ejections: metrics.ejections.clone(),
        }
    }

    /// Counts a failure of `upstream`, and the ejection it may cause.
    fn failure(&self, upstream: &Upstream) {
        if upstream.record_failure(self.eject_after, self.ejection) {
            self.ejections.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replicas::{EngineKind, ReplicaSpec, Replicas};

    /// The client's path and query follow the replica's URL, with or without a path of its own.
    #[test]
    fn a_replica_uri_is_its_url_and_the_client_path() {
        let replicas = Replicas::new();
        for (name, url, client, expected) in [
            (
                "plain",
                "http://10.0.0.7:8000",
                "/v1/completions?x=%20y",
                "http://10.0.0.7:8000/v1/completions?x=%20y",
            ),
            ("prefix", "http://gw:80/replica-0", "/v1/models", "http://gw:80/replica-0/v1/models"),
            ("ipv6", "http://[fd00::7]:8000/", "/health", "http://[fd00::7]:8000/health"),
            ("https", "https://h:1", "/v1/models", "https://h:1/v1/models"),
            ("https, a path", "https://gw/r-1", "/v1/models", "https://gw/r-1/v1/models"),
        ] {
            let mut spec = ReplicaSpec::new(name, "tcp://h:0", EngineKind::Vllm, "m");
            spec.http_url = url.into();
            let replica = replicas.insert(spec).unwrap();
            assert_eq!(
                replica.origin.is_some(),
                !name.contains("prefix") && !name.contains("path"),
                "{name}"
            );
            let client = client.parse::<Uri>().unwrap();
            assert_eq!(replica_uri(&replica, &client).unwrap().to_string(), expected, "{name}");
        }
    }

    /// A retry goes to the best candidate not yet sent to, one passed over for want of room
    /// included (it may have room now), and waits for the saturated ones when none takes it.
    #[test]
    fn a_retry_goes_to_the_best_candidate_left_wherever_it_stands() {
        let ids = [ReplicaId(7), ReplicaId(8), ReplicaId(9)];
        let left = |retries: [Retry; 3], sent_to: &[usize]| {
            let candidates = retries.into_iter().zip(ids).enumerate();
            let left = candidates.filter(|(i, _)| !sent_to.contains(i)).map(|(i, (r, id))| (i, r, id));
            first_to_take(left, Some).map(|(i, _)| i)
        };
        // Sent to the first and the third: the second, saturated when the first failed, is
        // waited for, or taken once it has room.
        assert_eq!(left([Retry::Takes, Retry::Saturated, Retry::Takes], &[0, 2]), Err(vec![ids[1]]));
        assert_eq!(left([Retry::Takes, Retry::Takes, Retry::Takes], &[0, 2]), Ok(1));
        assert_eq!(left([Retry::Takes, Retry::Saturated, Retry::Takes], &[0]), Ok(2));
        assert_eq!(left([Retry::Takes, Retry::Not, Retry::Saturated], &[0]), Err(vec![ids[2]]));
        assert_eq!(left([Retry::Takes, Retry::Not, Retry::Takes], &[0, 2]), Err(vec![]));
        // One whose last room another request took since counts as saturated.
        let retries =
            || [(0, Retry::Takes, ids[0]), (1, Retry::Saturated, ids[1]), (2, Retry::Takes, ids[2])];
        assert_eq!(first_to_take(retries().into_iter(), |i| (i == 2).then_some("taken")), Ok((2, "taken")));
        assert_eq!(first_to_take(retries().into_iter(), |_| None::<()>), Err(ids.to_vec()));
    }

    #[test]
    fn hop_by_hop_headers_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("keep-alive, x-secret-hop"));
        h.insert("x-secret-hop", HeaderValue::from_static("1"));
        h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
        h.insert(header::HOST, HeaderValue::from_static("router"));
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        strip_hop_by_hop(&mut h);
        let mut left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        left.sort_unstable();
        assert_eq!(left, vec!["authorization", "content-type"]);
    }

    #[test]
    fn every_connection_field_and_every_name_they_list_are_dropped() {
        let mut h = HeaderMap::new();
        h.append(header::CONNECTION, HeaderValue::from_static("close"));
        h.append(header::CONNECTION, HeaderValue::from_static("Keep-Alive , X-Other-Hop,absent,"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-other-hop", HeaderValue::from_static("1"));
        h.insert(header::UPGRADE, HeaderValue::from_static("h2c"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.append("x-kept", HeaderValue::from_static("a"));
        h.append("x-kept", HeaderValue::from_static("b"));
        strip_hop_by_hop(&mut h);
        let left: Vec<(&str, &str)> = h.iter().map(|(k, v)| (k.as_str(), v.to_str().unwrap())).collect();
        assert_eq!(left, vec![("x-kept", "a"), ("x-kept", "b")]);
    }

    /// A `Connection` value that is not UTF-8 somewhere still names its fields.
    #[test]
    fn a_connection_value_that_is_not_utf8_still_names_its_fields() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_bytes(b"x-hop, x-\xff").unwrap());
        h.insert("x-hop", HeaderValue::from_static("1"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left, vec!["x-kept"]);
    }
}
