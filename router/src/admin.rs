//! The router's gRPC admin service (`kvroute.v1.RouterAdmin`): `ListReplicas` with stream
//! state and load, `Explain` (where would this request go and why — every replica's overlap
//! and cost, changing nothing), `AddReplica`, `RemoveReplica` (frees its index entries) and
//! `Drain`.
//!
//! It listens on loopback by default. With `--admin-token`, every call must carry
//! `authorization: Bearer <token>` (compared in constant time); the router refuses to start
//! with the admin service beyond loopback and no token. The token is never logged.

use std::sync::Arc;

use kvroute_proto::openai::{Endpoint, RequestError};
use kvroute_proto::pb::{self, router_admin_server::RouterAdmin};
use tonic::{Request, Response, Status};

use crate::fleet::{Fleet, Member};
use crate::ingest::IngestError;
use crate::proxy::ProxyState;
use crate::proxy::error::ProxyError;
use crate::proxy::route::{Plan, Scored};
use crate::proxy::upstream::Ineligible;
use crate::replicas::{EngineKind, ReplicaSpec, SpecError, base_url};

/// Implements `RouterAdmin` over the proxy's state.
#[derive(Clone)]
pub struct AdminService {
    state: Arc<ProxyState>,
    model: String,
    block_size: u32,
}

impl AdminService {
    pub fn new(state: Arc<ProxyState>, model: String, block_size: u32) -> Self {
        Self { state, model, block_size }
    }

    /// The tonic service, behind the bearer-token check when `token` is set.
    pub fn into_server(
        self,
        token: Option<String>,
    ) -> tonic::service::interceptor::InterceptedService<
        pb::router_admin_server::RouterAdminServer<Self>,
        BearerAuth,
    > {
        // `Explain` takes any body the proxy takes: tonic's 4 MiB default refused long prompts
        // (and images) the proxy routes, up to `--max-body-bytes`.
        let largest = self.state.forward.max_body_bytes.saturating_add(EXPLAIN_FRAMING);
        let server = pb::router_admin_server::RouterAdminServer::new(self).max_decoding_message_size(largest);
        tonic::service::interceptor::InterceptedService::new(
            server,
            BearerAuth { token: token.map(Arc::from) },
        )
    }

    fn fleet(&self) -> &Fleet {
        self.state.fleet()
    }

    fn status(&self, m: &Member) -> pb::ReplicaStatus {
        let spec = &m.replica.spec;
        let s = &m.replica.status;
        let load = m.upstream.load();
        let listed = m.upstream.listed_adapters();
        pb::ReplicaStatus {
            spec: Some(spec_message(spec)),
            state: pb::StreamState::from(s.state()) as i32,
            blocks: self.state.decider.index.blocks(m.replica.id) as u64,
            in_flight: load.in_flight,
            pending_prefill_tokens: load.pending_prefill_tokens,
            healthy: m.upstream.is_healthy(),
            health_late: m.upstream.is_late(),
            draining: m.upstream.is_draining(),
            not_serving: !m.upstream.is_serving(),
            lora_adapters: m.upstream.adapters(),
            lists_adapters: listed.is_some(),
            listed_adapters: listed.unwrap_or_default(),
            epoch: s.epoch().0,
            last_seq: s.last_seq().map_or(0, |q| q.0),
            events_applied: s.events_applied(),
            events_malformed: s.events_malformed(),
            gaps: s.gaps(),
            ranks: m.replica.ranks.get().map(|ranks| rank_statuses(m, ranks)).unwrap_or_default(),
        }
    }
}

/// `spec` as the admin service's messages carry it (`ListReplicas`, `AddReplica`).
pub fn spec_message(spec: &ReplicaSpec) -> pb::ReplicaSpec {
    pb::ReplicaSpec {
        id: spec.name.clone(),
        http_url: spec.http_url.clone(),
        event_endpoint: spec.event_endpoint.clone(),
        replay_endpoint: spec.replay_endpoint.clone().unwrap_or_default(),
        grpc_endpoint: spec.grpc_endpoint.clone().unwrap_or_default(),
        engine: pb::EngineKind::from(spec.engine) as i32,
        dp_size: spec.dp_size,
        topic: spec.topic.clone(),
        role: pb::ReplicaRole::from(spec.role) as i32,
        bootstrap_port: spec.bootstrap_port.map_or(0, u32::from),
    }
}

/// Each rank of a data-parallel replica, as `ListReplicas` shows it.
fn rank_statuses(m: &Member, ranks: &crate::index::Ranks) -> Vec<pb::RankStatus> {
    let state = |rank| m.replica.status.rank_state(rank).unwrap_or(crate::replicas::StreamState::Degraded);
    ranks
        .views(&[])
        .into_iter()
        .map(|view| pb::RankStatus {
            rank: view.rank,
            state: pb::StreamState::from(state(view.rank)) as i32,
            blocks: ranks.index.blocks(ranks.id(view.rank)) as u64,
            in_flight: view.in_flight,
            pending_prefill_tokens: view.pending_prefill_tokens,
            others: view.others,
        })
        .collect()
}

fn candidate(c: &Scored, block_size: usize, prompt_tokens: usize) -> pb::Candidate {
    pb::Candidate {
        replica: c.member.replica.spec.name.clone(),
        overlap_blocks: c.view.overlap_blocks as u32,
        predicted_cached_tokens: kvroute_proto::hit_tokens(c.view.overlap_blocks, block_size, prompt_tokens)
            as u64,
        in_flight: c.view.load.in_flight,
        pending_prefill_tokens: c.view.load.pending_prefill_tokens,
        cost: c.cost,
        eligible: c.view.eligible,
        reason: c.ineligible.map_or("", Ineligible::as_str).to_owned(),
        state: c.view.stream as i32,
        dp_rank: c.rank,
        others: c.view.load.others,
        recent_prompt_tokens: c.view.load.recent_prompt_tokens,
        offloaded_blocks: c.view.offloaded_blocks as u32,
        dp_rank_load: c.rank_load.map(|load| pb::Load {
            in_flight: load.in_flight,
            pending_prefill_tokens: load.pending_prefill_tokens,
            others: load.others,
            recent_prompt_tokens: load.recent_prompt_tokens,
        }),
    }
}

#[tonic::async_trait]
impl RouterAdmin for AdminService {
    async fn list_replicas(
        &self,
        _: Request<pb::ListReplicasRequest>,
    ) -> Result<Response<pb::ListReplicasResponse>, Status> {
        let replicas = self.fleet().members().iter().map(|m| self.status(m)).collect();
        Ok(Response::new(pb::ListReplicasResponse { replicas }))
    }

    async fn explain(
        &self,
        request: Request<pb::ExplainRequest>,
    ) -> Result<Response<pb::ExplainResponse>, Status> {
        let request = request.into_inner();
        let path = if request.path.is_empty() { "/v1/completions" } else { request.path.as_str() };
        let endpoint = Endpoint::from_path(path)
            .ok_or_else(|| Status::invalid_argument(format!("{path} is not a routed path")))?;
        // A request the proxy would refuse (malformed, or beyond --max-prompt-tokens or
        // --max-completion-tokens) is explained by that refusal.
        let limits = self.state.admission.get().limits;
        let explained = async {
            let explained = self.state.decider.explain_split(endpoint, &request.body).await?;
            limits.check(&explained.plan, endpoint)?;
            Ok(explained)
        };
        let explained = explained.await.map_err(|e| match e {
            // Requests the proxy takes (within its limits), but not on a prefix.
            ProxyError::BadRequest(RequestError::PromptEmbeds(asked)) => {
                match limits.check_completion(asked.max_tokens, endpoint) {
                    Err(refused) => Status::invalid_argument(refused.to_string()),
                    Ok(()) => Status::failed_precondition(
                        "not decided on a prefix: a completion of prompt_embeds goes to the least-loaded replica",
                    ),
                }
            }
            ProxyError::BadRequest(RequestError::StoredConversation) => Status::failed_precondition(
                "not decided on a prefix: a continuation of a stored response goes to the replica that stored it",
            ),
            ProxyError::BadRequest(e) => Status::invalid_argument(e.to_string()),
            e if e.status().is_client_error() => Status::invalid_argument(e.to_string()),
            e => Status::unavailable(e.to_string()),
        })?;
        let candidates = |plan: &Plan| -> Vec<pb::Candidate> {
            plan.candidates.iter().map(|c| candidate(c, plan.block_size, plan.first_prompt_tokens)).collect()
        };
        let chosen =
            |plan: &Plan| plan.chosen().map(|c| c.member.replica.spec.name.clone()).unwrap_or_default();
        let (plan, prefill) = (&explained.plan, explained.prefill.as_ref());
        Ok(Response::new(pb::ExplainResponse {
            chosen: chosen(plan),
            policy: plan.routing.policy.kind().as_str().into(),
            prompt_tokens: plan.prompt_tokens as u32,
            request_blocks: plan.blocks.len() as u32,
            candidates: candidates(plan),
            split: explained.split.into(),
            prefill_chosen: prefill.map(chosen).unwrap_or_default(),
            prefill_candidates: prefill.map(candidates).unwrap_or_default(),
        }))
    }

    async fn add_replica(
        &self,
        request: Request<pb::AddReplicaRequest>,
    ) -> Result<Response<pb::ReplicaStatus>, Status> {
        let spec = request.into_inner().spec.ok_or_else(|| Status::invalid_argument("spec is required"))?;
        // Unspecified is the default; a value this router does not know (a newer client's) is
        // refused, not taken for the default.
        let engine = match pb::EngineKind::try_from(spec.engine) {
            Ok(pb::EngineKind::Unspecified) => Ok(EngineKind::Kvroute),
            Ok(engine) => EngineKind::try_from(engine).map_err(|e| e.to_string()),
            Err(_) => Err(format!("unknown engine kind {}", spec.engine)),
        }
        .map_err(Status::invalid_argument)?;
        let role = pb::ReplicaRole::try_from(spec.role)
            .map_err(|_| Status::invalid_argument(format!("unknown replica role {}", spec.role)))?;
        let http_url =
            base_url(&spec.http_url).map_err(|e| Status::invalid_argument(format!("http_url: {e}")))?;
        let mut replica = ReplicaSpec::new(spec.id, spec.event_endpoint, engine, self.model.clone());
        replica.http_url = http_url;
        replica.replay_endpoint = Some(spec.replay_endpoint).filter(|e| !e.is_empty());
        replica.grpc_endpoint = Some(spec.grpc_endpoint).filter(|e| !e.is_empty());
        replica.dp_size = spec.dp_size.max(1);
        replica.topic = spec.topic;
        replica.block_size = Some(self.block_size);
        replica.role = role.into();
        replica.bootstrap_port = match spec.bootstrap_port {
            0 => None,
            port => Some(u16::try_from(port).map_err(|_| {
                Status::invalid_argument(format!("bootstrap_port {port} is not a port number"))
            })?),
        };
        let member = self.fleet().add(replica).map_err(|e| match e {
            IngestError::Removing(_) | IngestError::ShutDown => Status::unavailable(e.to_string()),
            IngestError::Spec(
                SpecError::Duplicate(_) | SpecError::SameServer { .. } | SpecError::SameStream { .. },
            ) => Status::already_exists(e.to_string()),
            IngestError::Spec(_) => Status::invalid_argument(e.to_string()),
        })?;
        Ok(Response::new(self.status(&member)))
    }

    async fn remove_replica(
        &self,
        request: Request<pb::RemoveReplicaRequest>,
    ) -> Result<Response<pb::RemoveReplicaResponse>, Status> {
        let id = request.into_inner().id;
        if id.is_empty() {
            return Err(Status::invalid_argument("id is empty: name the replica to remove"));
        }
        // The drain goes before the removal's wait: a call cut short there (its deadline
        // passed) still removes the replica, and must not leave the name drained.
        let removed = self.fleet().remove_for_good(&id).await;
        Ok(Response::new(pb::RemoveReplicaResponse {
            removed: removed.freed.is_some(),
            blocks_freed: removed.freed.unwrap_or(0) as u64,
            drain_lifted: removed.drain_lifted,
        }))
    }

    async fn drain(&self, request: Request<pb::DrainRequest>) -> Result<Response<pb::ReplicaStatus>, Status> {
        let request = request.into_inner();
        let member = self.fleet().set_draining(&request.id, request.drain).map_err(|kept| {
            let kept = match (request.drain, kept) {
                (true, true) => format!(" now ({DRAIN_KEPT}: a replica added under it comes up drained)"),
                (false, true) => format!(" ({DRAIN_LIFTED})"),
                (_, false) => String::new(),
            };
            Status::not_found(format!("no replica named {:?}{kept}", request.id))
        })?;
        tracing::info!(replica = %request.id, drain = request.drain, "drain changed");
        Ok(Response::new(self.status(&member)))
    }
}

/// Room for an `ExplainRequest`'s path and framing beside a body of `--max-body-bytes`.
const EXPLAIN_FRAMING: usize = 64 * 1024;

/// What a `Drain` of a name out of the fleet says when the router keeps the drain for the
/// name's return (a `NOT_FOUND` all the same).
pub const DRAIN_KEPT: &str = "the drain is kept for the name";

/// What a `Drain` that lifts the drain of a name out of the fleet says (a `NOT_FOUND`).
pub const DRAIN_LIFTED: &str = "a drain kept for the name is lifted";

/// Checks `authorization: Bearer <token>` when a token is configured.
#[derive(Clone)]
pub struct BearerAuth {
    token: Option<Arc<str>>,
}

impl tonic::service::Interceptor for BearerAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(token) = &self.token else { return Ok(request) };
        let given = request.metadata().get("authorization").map(|v| v.as_bytes());
        if kvroute_proto::api_key::bearer_matches(given, &[token]) {
            Ok(request)
        } else {
            Err(Status::unauthenticated("a valid bearer token is required"))
        }
    }
}
