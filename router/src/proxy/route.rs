//! The decision path: parse the body just enough, get its token ids, hash them with the cache
//! namespace (the shared chain), look up every replica's cached prefix in one index walk,
//! extend it through pending credits, and let the policy weigh prefix against load.
//!
//! A completion request with several prompts goes to one replica: it is routed on its first
//! prompt's blocks, and its load counts every prompt's tokens.
//!
//! Eligibility comes from [`verdicts`]: when every replica that is up is ejected, the ejected
//! ones are eligible after all, so passive ejection never leaves the router nothing to try.

use std::sync::Arc;
use std::time::Instant;

use kvroute_proto::hash::{extend_chain, tie_key};
use kvroute_proto::openai::request::{MAX_N, anthropic};
use kvroute_proto::openai::{Endpoint, InlineSystem, ParsedRequest, Tokenization};
use kvroute_proto::pb::StreamState as PbState;
use kvroute_proto::{BlockHash, ReplicaId, chain, hit_tokens};
use xxhash_rust::xxh3::xxh3_64;

use super::error::ProxyError;
use super::live::{Live, Routing};
use super::prompts::{PromptError, Prompts};
use super::upstream::{Adapter, Ineligible, LoadGuard, verdicts_for};
use crate::fleet::{Fleet, Member};
use crate::index::{CreditHold, Overlaps, SharedIndex};
use crate::metrics::ProxyMetrics;
use crate::policy::{self, Policy, ReplicaView, RequestView};
use crate::replicas::StreamState;

/// Everything the decision needs, shared by all requests.
pub struct Decider {
    pub fleet: Fleet,
    pub index: SharedIndex,
    /// The blocks replicas offloaded to host memory ([`crate::Ingest::host_index`]).
    pub host_index: SharedIndex,
    /// The policy and what else decisions route by, as a reload leaves them.
    pub routing: Live<Routing>,
    pub prompts: Prompts,
    pub block_size: usize,
    /// The vLLM replicas run EAGLE or MTP speculative decoding ([`crate::Config::eagle`]).
    pub eagle: bool,
    pub metrics: ProxyMetrics,
    /// One is held while a cache-aware decision (or a retry) scores, credits its choice and
    /// counts its load there, chosen by the request's first block: the next decision of a
    /// request that begins alike sees its credits and its load. (Two deciding at once each
    /// saw none of the other's, and a burst of requests on a new shared prefix went to as
    /// many replicas as threads decided it.) Requests that begin otherwise decide in
    /// parallel, and tokenizing and hashing are done before.
    pub deciding: Deciding,
}

/// The locks of [`Decider::deciding`].
#[derive(Debug, Default)]
pub struct Deciding([std::sync::Mutex<()>; DECIDING_SHARDS]);

/// How many times more than there are replicas a decision may find, in a row, that a request
/// deciding at the same time took its choice's last room, before the request waits for room
/// ([`Decider::decide_prepared`]).
const MAX_RACES: usize = 3;

/// How many [`Deciding`] locks there are.
const DECIDING_SHARDS: usize = 32;

impl Deciding {
    /// The lock of requests whose first block is `first`.
    fn lock(&self, first: &BlockHash) -> std::sync::MutexGuard<'_, ()> {
        let shard = (first.0 % DECIDING_SHARDS as u64) as usize;
        self.0[shard].lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Per-request bounds checked after tokenization, before anything is credited or forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// Prompt tokens of all of a request's prompts together.
    pub max_prompt_tokens: u64,
    /// The largest `max_tokens` (or `max_completion_tokens`) a request may ask for.
    pub max_completion_tokens: u64,
}

impl RequestLimits {
    /// No bounds (benchmarks, `Explain`).
    pub const NONE: RequestLimits =
        RequestLimits { max_prompt_tokens: u64::MAX, max_completion_tokens: u64::MAX };

    /// Whether `plan`, of a request to `endpoint`, is within the bounds.
    pub fn check(&self, plan: &Plan, endpoint: Endpoint) -> Result<(), ProxyError> {
        self.check_tokens(plan.prompt_tokens, plan.max_tokens, endpoint)
    }

    /// Whether a request of `prompt_tokens` asking for `max_tokens` is within the bounds.
    fn check_tokens(
        &self,
        prompt_tokens: u64,
        max_tokens: Option<u64>,
        endpoint: Endpoint,
    ) -> Result<(), ProxyError> {
        if prompt_tokens > self.max_prompt_tokens {
            return Err(ProxyError::PromptTooLong { tokens: prompt_tokens, limit: self.max_prompt_tokens });
        }
        self.check_completion(max_tokens, endpoint)
    }

    /// Whether the completion tokens a request to `endpoint` asks for are within the bound.
    pub fn check_completion(&self, asked: Option<u64>, endpoint: Endpoint) -> Result<(), ProxyError> {
        match asked {
            Some(asked) if asked > self.max_completion_tokens => {
                let param = match endpoint {
                    Endpoint::Responses => "max_output_tokens",
                    Endpoint::Generate => "sampling_params.max_new_tokens",
                    _ => "max_tokens",
                };
                Err(ProxyError::TooManyTokens { param, asked, limit: self.max_completion_tokens })
            }
            _ => Ok(()),
        }
    }
}

/// One candidate as the decision saw it (what `Explain` shows).
#[derive(Clone, Debug)]
pub struct Scored {
    pub member: Member,
    pub view: ReplicaView,
    /// Leading blocks of the request the index already shows on the replica (0 when its
    /// stream is `FALLBACK`); they need no credit.
    pub indexed_blocks: usize,
    /// Leading blocks the index shows or earlier decisions' credits give it: this decision's
    /// own credit adds the blocks past them.
    pub credited_blocks: usize,
    pub cost: f64,
    /// Why it was not eligible, if it was not.
    pub ineligible: Option<Ineligible>,
    /// The data-parallel rank the request is sent to (`X-data-parallel-rank`), chosen as
    /// replicas are ([`crate::index::Ranks`]); `None` for a replica of one rank, or with a
    /// policy other than cache-aware.
    pub rank: Option<u32>,
    /// Leading blocks of the request that rank holds (index and credits).
    pub rank_blocks: usize,
    /// Of those, the ones its index shows (credits not counted): the rest are credited to it.
    pub rank_indexed: usize,
    /// That rank's load, which chose it among the replica's ranks.
    pub rank_load: Option<policy::Load>,
}

/// Which replicas a decision is among, by their [`crate::replicas::Role`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hop {
    /// A request's own: replicas that decode (every replica of a fleet without roles).
    Whole,
    /// A request's own that goes without a bootstrap room (it is not split): replicas that
    /// decode, SGLang's decode replicas excepted ([`super::disagg`]).
    Roomless,
    /// The prefill of a request decoded on the replica named: replicas that prefill and hand
    /// their KV over as vLLM's do, that one excepted ([`super::disagg`]).
    Prefill(ReplicaId),
    /// The prefill of a request decoded on an SGLang decode replica: SGLang's prefill
    /// replicas, which hand their KV over through a bootstrap room ([`super::disagg`]).
    Bootstrap,
}

impl Hop {
    /// Whether it is the prefill of a request decoded elsewhere.
    pub fn is_prefill(self) -> bool {
        matches!(self, Hop::Prefill(_) | Hop::Bootstrap)
    }

    /// Whether `member` is one of the replicas it goes to.
    pub(super) fn takes(self, member: &Member) -> bool {
        let role = member.replica.spec.role;
        match self {
            Hop::Whole => role.decodes(),
            Hop::Roomless => role.decodes() && !member.replica.spec.waits_for_a_room(),
            Hop::Prefill(decode) => {
                role.prefills() && member.replica.id != decode && !member.replica.spec.bootstraps()
            }
            Hop::Bootstrap => role == crate::replicas::Role::Prefill && member.replica.spec.bootstraps(),
        }
    }
}

/// A request read, tokenized and hashed, to be decided on the fleet as it is when it is
/// ([`Decider::prepare`]).
#[derive(Debug)]
pub struct Prepared {
    /// The endpoint it was sent to (a Messages request is decided as a chat).
    asked: Endpoint,
    /// The fleet when it was read, for its first decision (a later one reads it again), and
    /// the fleet's change count then.
    members: std::sync::Mutex<Option<Vec<Member>>>,
    changes: u64,
    blocks: Arc<[BlockHash]>,
    all_blocks: Arc<[BlockHash]>,
    view: RequestView,
    first_prompt_tokens: usize,
    /// The model it asks for (a LoRA adapter's request goes only where it may be:
    /// [`Decider::adapter`]).
    model: Arc<str>,
    max_tokens: Option<u64>,
    unhashed_tokens: Option<usize>,
    streams: bool,
    prompts: u32,
    /// Its prompt is a list (a batch, of one prompt too).
    listed: bool,
    choices: u32,
    sequences: u32,
    /// It goes without a bootstrap room ([`super::disagg::Shape::goes_without_a_room`]) in a fleet of
    /// replicas that wait for one: it is decided among those that need none ([`Hop::Roomless`]).
    roomless: bool,
    /// Its place among requests waiting for room ([`ParsedRequest::priority`]).
    pub priority: i64,
    /// When its first decision started ([`Decider::decide_prepared`]).
    started: Instant,
}

impl Prepared {
    /// The fleet it read, for its first decision only (`None` after).
    fn first_members(&self) -> Option<Vec<Member>> {
        self.members.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take()
    }
}

/// [`Decider::explain_split`]'s answer.
#[derive(Debug)]
pub struct Explained {
    /// The request's decision (its decode replica's, when it is split).
    pub plan: Plan,
    /// How it is split ([`super::disagg::Split::as_str`]).
    pub split: &'static str,
    /// Its prefill's decision, when it is split.
    pub prefill: Option<Plan>,
}

/// Why SGLang's `/generate` has nowhere to go in a fleet of vLLM replicas.
pub const NO_GENERATE: &str = "no replica serves SGLang's /generate (vLLM's replicas do not)";

/// The outcome of a decision.
#[derive(Debug)]
pub struct Plan {
    /// The routing it was decided by (a reload meanwhile changes the next decisions only):
    /// its retries take the same lock. (Not the same `--max-in-flight-per-replica`: a
    /// replica's room is the limit in force, whose rise lets a waiting retry in.)
    pub routing: Arc<Routing>,
    /// Candidates to try, best first (the chosen one, the other eligible ones by cost, then
    /// those at `--max-in-flight-per-replica`, whose room a retry may wait for, by cached
    /// prefix): indices into `candidates` ([`Plan::order`]).
    order: Vec<usize>,
    /// Every replica of its [`Hop`], scored, in fleet order.
    pub candidates: Vec<Scored>,
    pub prompt_tokens: u64,
    /// Full blocks of the routed prompt.
    pub blocks: Arc<[BlockHash]>,
    /// Blocks of every prompt, credited to the chosen replica.
    pub all_blocks: Arc<[BlockHash]>,
    /// Tokens of the routed (first) prompt.
    pub first_prompt_tokens: usize,
    /// For a chat with media, how many of those are past what could be hashed; `None` when
    /// every token was.
    pub unhashed_tokens: Option<usize>,
    pub block_size: usize,
    /// The request's `max_tokens` (`max_completion_tokens` for chat), if it set one.
    pub max_tokens: Option<u64>,
    /// Sequences the replica will run for it: its prompts times its `n`.
    pub sequences: u32,
    /// Its prompts (a completion's batch has several), whether they came as a list (of one
    /// too), and its `n`.
    pub prompts: u32,
    pub listed: bool,
    pub choices: u32,
    /// The decision's pinned credits on the replica the request goes to (none for
    /// `Explain`): the forwarder hands them to the response, which lets them go when the
    /// replica's first output arrives.
    pub hold: Option<CreditHold>,
    /// The request's load on the replica it goes to first, counted when it was decided
    /// ([`Decider::begin`]; none for `Explain`): the forwarder sends it there with it.
    pub load: Option<LoadGuard>,
    /// What a Responses request's replica keeps of its answer (`store`, `background`): a
    /// kept response's id is learned from its answer ([`super::responses::Owners`]).
    pub keeps_response: super::responses::Keeps,
    /// The answer streams: its first data comes right after the prefill. (A whole answer
    /// comes only at the end, so the prefill's end is read off the replica's events.)
    pub streams: bool,
    /// The request as the policy sees it (for a retry's scoring: [`Decider::rescore`]).
    request: RequestView,
    /// The model the request asks for (for the access log; `None` for `Explain`'s).
    pub model: Option<Arc<str>>,
    /// Where the prompt was computed, when it is decoded after a remote prefill
    /// ([`super::disagg`]).
    pub prefilled_by: Option<super::disagg::Remote>,
    /// Its answer counts in the hit rate (not after a prefill sent ahead, which counted).
    pub counted: bool,
    /// The replicas it was decided among.
    pub hop: Hop,
    /// The fleet it was decided on has replicas of a role other than `both`: its prefill may
    /// go ahead to a prefill replica ([`super::disagg`]).
    pub disaggregated: bool,
}

impl Plan {
    /// Replicas to try, best first: the chosen one, the other eligible ones by cost, then
    /// those that were saturated (a retry takes them only once they have room).
    pub fn order(&self) -> impl ExactSizeIterator<Item = &Scored> {
        self.order.iter().map(|&i| &self.candidates[i])
    }

    /// Whether the request has several prompts (a completion's batch): its prediction is
    /// its first prompt's, and one prompt's last block tells nothing of the others' prefill.
    pub fn is_batch(&self) -> bool {
        self.prompt_tokens != self.first_prompt_tokens as u64
    }

    /// The replica the request goes to first, if any is eligible.
    pub fn chosen(&self) -> Option<&Scored> {
        self.order().next()
    }

    /// Leaves the request no replica to retry on: its chosen one only.
    pub fn without_retries(&mut self) {
        self.order.truncate(1);
    }

    /// The blocks `replica` is credited with when the request goes to it: those past what the
    /// index already shows it holding.
    pub fn uncredited(&self, replica: &Scored) -> &[BlockHash] {
        &self.all_blocks[replica.indexed_blocks.min(self.all_blocks.len())..]
    }

    /// Of the request's blocks, how many it found held (`found`, on its replica or rank: the
    /// index's and earlier decisions' credits) as its credits count them: all of them when it
    /// was scored on none (a request that reads no cache, a batch whose first prompt is shorter
    /// than a block), which cannot tell which were held. Withdrawn, its credits then end none
    /// of them (they may be other requests'), only its pins.
    fn found_held(&self, found: usize) -> usize {
        if self.blocks.is_empty() { self.all_blocks.len() } else { found }
    }

    /// Tokens the `i`th replica of [`Plan::order`] is predicted to have cached.
    pub fn predicted_cached_tokens(&self, i: usize) -> u64 {
        self.order().nth(i).map_or(0, |s| self.hit(s))
    }

    /// Prompt tokens `replica` would have to prefill (all of them if it is no candidate).
    pub fn prefill_tokens_on(&self, replica: ReplicaId) -> u64 {
        let hit = self.candidates.iter().find(|s| s.member.replica.id == replica).map_or(0, |s| self.hit(s));
        self.prompt_tokens.saturating_sub(hit)
    }

    fn hit(&self, scored: &Scored) -> u64 {
        hit_tokens(scored.view.overlap_blocks, self.block_size, self.first_prompt_tokens) as u64
    }

    /// Prompt tokens the replica at `order[i]` will have to prefill.
    pub fn prefill_tokens(&self, i: usize) -> u64 {
        self.prompt_tokens.saturating_sub(self.predicted_cached_tokens(i))
    }
}

impl Decider {
    /// Requests in flight a replica may hold, as the routing is now.
    pub fn max_in_flight_per_replica(&self) -> u32 {
        self.routing.get().max_in_flight_per_replica
    }

    /// The LoRA adapter a request for `model` is for, if it names one: one loaded through the
    /// router, else one the tokenization knows (configured or learned).
    pub fn adapter<'m>(&self, model: &'m str) -> Option<Adapter<'m>> {
        if self.fleet.adapters().contains(model) {
            return Some(Adapter::Loaded(model));
        }
        let tokenization = self.prompts.tokenization();
        (model != tokenization.base_model() && tokenization.is_lora_adapter(model))
            .then_some(Adapter::Listed(model))
    }

    /// Chooses a replica for a request; also credits the chosen one with its blocks.
    pub async fn decide(&self, endpoint: Endpoint, body: &[u8]) -> Result<Plan, ProxyError> {
        self.decide_within(endpoint, body, &RequestLimits::NONE).await
    }

    /// [`Decider::decide`], refusing requests beyond `limits` (before any credit).
    pub async fn decide_within(
        &self,
        endpoint: Endpoint,
        body: &[u8],
        limits: &RequestLimits,
    ) -> Result<Plan, ProxyError> {
        let prepared = self.prepare(endpoint, body).await?;
        self.decide_prepared(&prepared, limits)
    }

    /// The request read, tokenized and hashed, to be decided ([`Decider::decide_prepared`]) as
    /// often as it has to wait for room ([`super::queue`]): what it is does not change while it
    /// waits.
    pub async fn prepare(&self, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ProxyError> {
        let started = Instant::now();
        let prepared = self.read(endpoint, body, started).await;
        if prepared.is_err() {
            // Every decision's time, those that fail included (a `/tokenize` that timed out).
            self.metrics.decision_seconds.observe(started.elapsed().as_secs_f64());
        }
        prepared
    }

    /// [`Decider::decide_within`] for a prepared request: the index, credits and load as they
    /// are now. (Its first decision's time includes its preparation; a later one's is its own.)
    pub fn decide_prepared(&self, prepared: &Prepared, limits: &RequestLimits) -> Result<Plan, ProxyError> {
        self.decide_hop(prepared, limits, Hop::Whole)
    }

    /// [`Decider::decide_prepared`] among the replicas `hop` goes to.
    pub fn decide_hop(
        &self,
        prepared: &Prepared,
        limits: &RequestLimits,
        hop: Hop,
    ) -> Result<Plan, ProxyError> {
        let members = prepared.first_members();
        let started = if members.is_some() { prepared.started } else { Instant::now() };
        let routing = self.routing.get();
        let decided = self.decide_locked(&routing, prepared, (members, hop), limits);
        self.metrics.decision_seconds.observe(started.elapsed().as_secs_f64());
        let plan = decided?;
        self.metrics.count_decision(routing.policy.kind());
        if plan.unhashed_tokens.is_some() {
            self.metrics.partial_prompts.inc();
        }
        Ok(plan)
    }

    /// [`Decider::decide_prepared`]'s decision, made under its lock ([`Decider::deciding`]),
    /// on the fleet `members` if given: the plan, its choice credited and its load counted
    /// there. Made again when another request took the chosen replica's last room since it
    /// was scored (saturated now), as long as a replica is left with room (up to
    /// [`MAX_RACES`] times more than there are replicas; then the request waits for room).
    fn decide_locked(
        &self,
        routing: &Arc<Routing>,
        prepared: &Prepared,
        (mut members, hop): (Option<Vec<Member>>, Hop),
        limits: &RequestLimits,
    ) -> Result<Plan, ProxyError> {
        // Checked before any choice: a request refused would take a turn of round-robin (or a
        // draw of random) and send nothing, skipping a replica.
        limits.check_tokens(prepared.view.prompt_tokens as u64, prepared.max_tokens, prepared.asked)?;
        let _one = self.deciding(routing, &prepared.all_blocks);
        let mut raced = 0;
        loop {
            let mut plan = self.plan_prepared(routing, prepared, (members.take(), hop), true);
            if plan.chosen().is_none() {
                return Err(unavailable(&plan));
            }
            self.credit(&mut plan, 0);
            // Under the limit it was scored with (a reload meanwhile counts from the next).
            if let Some(load) = self.begin(&mut plan, 0, routing.max_in_flight_per_replica) {
                plan.load = Some(load);
                return Ok(plan);
            }
            self.withdraw_credit(&mut plan);
            raced += 1;
            // Each race is a room another request took: while the plan has a choice, the
            // fleet has room. (Bounded all the same: past it, the request waits for room on
            // any candidate.)
            if raced >= plan.candidates.len() + MAX_RACES {
                let reason = "the replicas chosen were saturated by requests deciding at once".into();
                let replicas = plan.candidates.iter().map(|c| c.member.replica.id).collect();
                return Err(ProxyError::Saturated { reason, replicas });
            }
        }
    }

    /// The request goes to the `at`th replica of `plan`'s order: credits it with the request's
    /// blocks (those past what the index shows it holding), pinned while the request is there.
    /// A replica whose stream is FALLBACK gets none: no event would confirm them, and no
    /// decision reads them there.
    pub fn credit(&self, plan: &mut Plan, at: usize) {
        let Some(replica) = plan.order().nth(at) else { return };
        if replica.view.stream == PbState::Fallback {
            plan.hold = None;
            return;
        }
        let (id, blocks) = (replica.member.replica.id, plan.uncredited(replica).to_vec());
        let credited = (Arc::clone(&plan.all_blocks), plan.found_held(replica.credited_blocks));
        plan.hold = Some(CreditHold::pin(&self.index, id, blocks).adding(credited.0, credited.1));
    }

    /// The [`Decider::deciding`] lock of a request with `blocks`, where credits steer the
    /// choice (cache-aware) and there are blocks to credit.
    fn deciding(&self, routing: &Routing, blocks: &[BlockHash]) -> Option<std::sync::MutexGuard<'_, ()>> {
        let credits_steer = routing.policy.kind() == policy::PolicyKind::CacheAware;
        blocks.first().filter(|_| credits_steer).map(|first| self.deciding.lock(first))
    }

    /// The request retried on the `at`th replica of `plan`'s order, under the lock its
    /// decision took: scored again there ([`Decider::rescore`]), the decision's credit moved
    /// there (the prefix's next requests follow it to the replica that will cache it) and its
    /// load counted ([`Decider::begin`]). `None`, its credit there withdrawn: another request
    /// took the replica's last room since it was picked.
    pub fn retry(&self, plan: &mut Plan, at: usize) -> Option<LoadGuard> {
        let routing = Arc::clone(&plan.routing);
        let _one = self.deciding(&routing, &plan.all_blocks);
        self.rescore(plan, at);
        self.credit(plan, at);
        // Under the limit in force: a retry may have waited for a room a reload gave.
        let load = self.begin(plan, at, self.max_in_flight_per_replica());
        if load.is_none() {
            self.withdraw_credit(plan);
        }
        load
    }

    /// Counts the request's load on the `at`th replica of `plan`'s order (and on the
    /// data-parallel rank it names there, which it credits with the request's blocks), if the
    /// replica has room for it under `max` (`--max-in-flight-per-replica`; `None`: another
    /// request took the last room since the replica was scored). Call after
    /// [`Decider::credit`]: a whole answer's pending prefill ends when its prompt's last block
    /// is stored.
    pub fn begin(&self, plan: &mut Plan, at: usize, max: u32) -> Option<LoadGuard> {
        let scored = plan.order().nth(at)?;
        let (member, rank) =
            (&scored.member, scored.rank.map(|rank| (rank, scored.rank_indexed, scored.rank_blocks)));
        let (sequences, prompt_tokens) = (plan.sequences, plan.prompt_tokens);
        // A prompt prefilled elsewhere is pulled: its last token is computed here (each
        // prompt's, of a batch).
        let prefill_tokens = match plan.prefilled_by {
            Some(_) => plan.prefill_tokens(at).min(u64::from(plan.prompts.max(1))),
            None => plan.prefill_tokens(at),
        };
        let mut load = member.upstream.try_begin(max, sequences, prefill_tokens, prompt_tokens)?;
        if let Some(((rank, indexed, held), ranks)) = rank.zip(member.replica.ranks.get()) {
            // The rank holds the request's pending prefill from here, before anything can
            // tell that it is done.
            let blocks = (&*plan.all_blocks, indexed, plan.found_held(held));
            load.hold_rank(ranks.begin(rank, sequences, blocks, prompt_tokens));
        }
        // A whole answer comes at its end: the prefill is over when the replica (its rank)
        // stores the prompt's last block. (Not for a batch: a later prompt's last block may
        // lie inside an earlier one. Nor for a chat with media: its blocks end before the
        // media, whose prefill comes after they are stored.)
        if !plan.streams
            && !plan.is_batch()
            && plan.unhashed_tokens.is_none()
            && !load.tell_when_rank_stored()
            && let Some(hold) = plan.hold.as_mut()
        {
            hold.tell_when_stored(load.pending_prefill());
        }
        Some(load)
    }

    /// The `at`th replica of `plan`'s order scored again on the index, credits and load as they
    /// are now, for a retry sent there: it may have waited for room there while the replica
    /// cached more of the prefix (its prediction, pending prefill, pins and rank would be
    /// the decision's). Its cost, and whether it was eligible, stay the decision's.
    pub fn rescore(&self, plan: &mut Plan, at: usize) {
        let Some(&i) = plan.order.get(at) else { return };
        let scored = &plan.candidates[i];
        let member = vec![scored.member.clone()];
        let (blocks, all_blocks) = (Arc::clone(&plan.blocks), Arc::clone(&plan.all_blocks));
        let tokens = (plan.first_prompt_tokens, None);
        let routing = Arc::clone(&plan.routing);
        let fresh =
            self.score((&routing, false), member, blocks, all_blocks, &plan.request, tokens).candidates.pop();
        if let Some(fresh) = fresh {
            let (cost, ineligible, eligible) = (scored.cost, scored.ineligible, scored.view.eligible);
            // A FALLBACK replica's overlap is the fleet's common one, which a score of it alone
            // cannot tell: the decision's stands.
            let overlap_blocks = match fresh.view.stream {
                PbState::Fallback => scored.view.overlap_blocks,
                _ => fresh.view.overlap_blocks,
            };
            let view = ReplicaView { eligible, overlap_blocks, ..fresh.view };
            plan.candidates[i] = Scored { cost, ineligible, view, ..fresh };
        }
    }

    /// The request failed without starting on the replica its credit is held on: the
    /// decision's credit there ends (a retry elsewhere is credited there: [`Decider::credit`]).
    pub fn withdraw_credit(&self, plan: &mut Plan) {
        if let Some(hold) = plan.hold.take() {
            hold.withdraw_own();
        }
    }

    /// Where a request would go and why, crediting and counting nothing and leaving the
    /// policy's turn or random stream where it is (the admin `Explain`); its tokenizing may
    /// fill the tokenizer's prefix cache.
    pub async fn explain(&self, endpoint: Endpoint, body: &[u8]) -> Result<Plan, ProxyError> {
        self.plan(endpoint, body, false).await
    }

    /// [`Decider::explain`], and in a fleet that disaggregates, how the request is split and
    /// its prefill's decision, as the proxy would make them (crediting nothing).
    pub async fn explain_split(&self, endpoint: Endpoint, body: &[u8]) -> Result<Explained, ProxyError> {
        let prepared = self.read(endpoint, body, Instant::now()).await?;
        let routing = self.routing.get();
        let decide = |hop| self.plan_prepared(&routing, &prepared, (prepared.first_members(), hop), false);
        let mut plan = decide(Hop::Whole);
        let split = super::disagg::Split::of(&plan, endpoint, body);
        let roomless = plan.chosen().is_some_and(|c| c.member.replica.spec.waits_for_a_room());
        if matches!(split, super::disagg::Split::NotSplit) && roomless {
            plan = decide(Hop::Roomless);
        }
        let prefill = split.prefill_hop().map(decide);
        // Without a prefill replica, vLLM's decode replica prefills; SGLang's cannot.
        let split = match (&split, prefill.as_ref().and_then(Plan::chosen)) {
            (super::disagg::Split::Remote { .. }, None) => "no_replica",
            (super::disagg::Split::Bootstrap { .. }, None) => {
                return Err(ProxyError::Unavailable("no SGLang replica of role prefill can take it".into()));
            }
            (split, _) => split.as_str(),
        };
        Ok(Explained { plan, split, prefill })
    }

    /// The decision for a request; `send` when it will be sent (the policy moves on).
    async fn plan(&self, endpoint: Endpoint, body: &[u8], send: bool) -> Result<Plan, ProxyError> {
        let prepared = self.read(endpoint, body, Instant::now()).await?;
        Ok(self.plan_prepared(&self.routing.get(), &prepared, (prepared.first_members(), Hop::Whole), send))
    }

    /// The request to `endpoint` in `body` read, tokenized and hashed; `started` when its
    /// decision did.
    async fn read(&self, endpoint: Endpoint, body: &[u8], started: Instant) -> Result<Prepared, ProxyError> {
        // A Messages body is decided as the chat request vLLM makes of it (and sent as it is).
        let (asked, sent, inline) = (endpoint, body, self.prompts.inline_system());
        let harmony = self.prompts.tokenization().is_harmony();
        let (endpoint, body) = Tokenization::readable_with(endpoint, body, inline, harmony)?;
        let body = &*body;
        let mut request = ParsedRequest::parse(endpoint, body)?;
        let listed = request.is_batch();
        let changes = self.fleet.changes();
        let members = self.fleet.members();
        if asked == Endpoint::Generate && !members.iter().any(|member| member.replica.spec.serves_generate())
        {
            return Err(ProxyError::Unavailable(NO_GENERATE.into()));
        }
        // A LoRA adapter's prompt is tokenized remotely by a replica that has it.
        let model = self.prompts.is_remote().then(|| request.model().to_owned());
        let adapter = model.as_deref().and_then(|model| self.adapter(model));
        let info = match self.prompts.tokens(&mut request, body, (&members, adapter)).await {
            // A replica's template that refuses a system turn mid-conversation is one vLLM
            // folds inline system messages for ([`InlineSystem`]); the router's own template,
            // which chose to keep them, is not the replicas' in remote mode.
            // (Remembered: later ones are folded from the start.)
            Err(PromptError::Refused(why))
                if asked == Endpoint::Messages
                    && inline == InlineSystem::Preserve
                    && self.prompts.is_remote() =>
            {
                let folded = anthropic::chat_body(sent, InlineSystem::Fold, harmony)?;
                if folded == body {
                    Err(PromptError::Refused(why))
                } else {
                    let mut again = ParsedRequest::parse(endpoint, &folded)?;
                    let tokens = self.prompts.tokens(&mut again, &folded, (&members, adapter)).await;
                    if tokens.is_ok() {
                        self.prompts.saw_replicas_fold();
                    }
                    tokens
                }
            }
            tokens => tokens,
        }
        .map_err(|e| match e {
            PromptError::Request(e) => ProxyError::BadRequest(e),
            PromptError::Remote(e) => ProxyError::Unavailable(e),
            failed @ PromptError::Tokenizing(_) => ProxyError::Unavailable(failed.to_string()),
            refused @ PromptError::Refused(_) => ProxyError::Refused(refused.to_string()),
            PromptError::NotServed(said) => {
                ProxyError::RefusedEverywhere { status: http::StatusCode::NOT_FOUND, said }
            }
        })?;
        let first = info.tokens.first().map(Vec::as_slice).unwrap_or_default();
        let unhashed = info.unhashed_tokens.unwrap_or(0);
        let root = info.namespace.root();
        let blocks: Arc<[BlockHash]> = chain(root, first, self.block_size).into();
        let prompt_tokens: u64 = info.tokens.iter().map(|t| t.len() as u64).sum::<u64>() + unhashed as u64;
        let all_blocks: Arc<[BlockHash]> = match info.tokens.len() > 1 {
            true => {
                let mut all = blocks.to_vec();
                for t in &info.tokens[1..] {
                    extend_chain(root, t, self.block_size, &mut all);
                }
                all.into()
            }
            false => Arc::clone(&blocks),
        };
        // What the request is, for ties: its tokens' chained hash, the partial last block
        // included (prompts that differ only there, short questions after one long shared
        // prefix, spread over an idle fleet too), or its body when no tokens are known; a
        // batch's later prompts and tokens past the known ones are in the body.
        let key = match first.is_empty() || info.tokens.len() > 1 || unhashed > 0 {
            true => xxh3_64(body),
            false => tie_key(root, &blocks, first, self.block_size),
        };
        let view = RequestView {
            prompt_tokens: prompt_tokens as usize,
            blocks: blocks.len(),
            block_size: self.block_size,
            key,
        };
        // Counted up to vLLM's bound on `n`, so that a replica's count cannot wrap.
        let prompts = u32::try_from(info.tokens.len().max(1)).unwrap_or(u32::MAX);
        let choices = request.n();
        let sequences = prompts.saturating_mul(choices).min(MAX_N);
        // (The body is read again only in front of SGLang's decode replicas.)
        let shape = super::disagg::Shape {
            endpoint: asked,
            prompts,
            choices,
            unhashed: info.unhashed_tokens.is_some(),
        };
        let roomless = members.iter().any(|member| member.replica.spec.waits_for_a_room())
            && shape.goes_without_a_room(sent);
        // A request for its prompt's logprobs reads no cache (vLLM skips the lookup, needing
        // every prompt token's; SGLang matches no prefix before `logprob_start_len`): routed
        // on load alone and predicted no hit, its prefill's blocks still credited.
        let blocks = if request.reads_no_cache(asked, sent) { Arc::from([]) } else { blocks };
        Ok(Prepared {
            asked,
            members: std::sync::Mutex::new(Some(members)),
            changes,
            blocks,
            all_blocks,
            view,
            first_prompt_tokens: first.len() + unhashed,
            model: request.model().into(),
            max_tokens: request.max_tokens(),
            unhashed_tokens: info.unhashed_tokens,
            streams: request.stream(),
            prompts,
            listed,
            choices,
            sequences,
            roomless,
            priority: request.priority(),
            started,
        })
    }

    /// The decision for a prepared request, on the fleet, index, credits and load as they are
    /// now (`first`: the fleet it read, for its first decision); `send` when it will be sent
    /// (the policy moves on).
    fn plan_prepared(
        &self,
        routing: &Arc<Routing>,
        prepared: &Prepared,
        (first, hop): (Option<Vec<Member>>, Hop),
        send: bool,
    ) -> Plan {
        // A replica that left since the members were read (while the prompt was tokenized,
        // remotely or on the blocking pool, or the request waited for room) is not chosen,
        // nor credited; one that joined is a candidate.
        let mut members = match first {
            Some(members) if self.fleet.changes() == prepared.changes => members,
            _ => self.fleet.members(),
        };
        let disaggregated = super::disagg::disaggregates(&members);
        let hop = if hop == Hop::Whole && prepared.roomless { Hop::Roomless } else { hop };
        let native = prepared.asked == Endpoint::Generate;
        members.retain(|member| hop.takes(member) && (!native || member.replica.spec.serves_generate()));
        // An adapter's request goes only where it may be.
        let adapter = self.adapter(&prepared.model);
        let (blocks, all_blocks) = (Arc::clone(&prepared.blocks), Arc::clone(&prepared.all_blocks));
        let tokens = (prepared.first_prompt_tokens, adapter);
        let mut plan = self.score((routing, send), members, blocks, all_blocks, &prepared.view, tokens);
        plan.max_tokens = prepared.max_tokens;
        plan.unhashed_tokens = prepared.unhashed_tokens;
        // A prefill sent ahead is answered whole.
        plan.streams = prepared.streams && !hop.is_prefill();
        plan.sequences = prepared.sequences;
        plan.prompts = prepared.prompts;
        plan.listed = prepared.listed;
        plan.choices = prepared.choices;
        plan.model = Some(Arc::clone(&prepared.model));
        plan.disaggregated = disaggregated;
        plan.hop = hop;
        plan
    }

    /// The rank views of each of `members` that is a data-parallel replica (`None` for the
    /// others), when ranks are chosen: the rank index walked once for all. Empty when there
    /// are none. A replica whose ranks are not all followed is FALLBACK (scored on what the
    /// fleet holds), and its ranks still chosen among those that are.
    fn rank_views(
        routing: &Routing,
        members: &[Member],
        blocks: &[BlockHash],
        now: tokio::time::Instant,
    ) -> Vec<Option<Vec<crate::index::RankView>>> {
        if routing.ranks_by.is_none() || !members.iter().any(|member| member.replica.ranks.get().is_some()) {
            return Vec::new();
        }
        let ranks: Vec<Option<&crate::index::Ranks>> =
            members.iter().map(|member| member.replica.ranks.get().map(|ranks| &**ranks)).collect();
        let walked: Vec<&crate::index::Ranks> = ranks.iter().flatten().copied().collect();
        if walked.is_empty() {
            return Vec::new();
        }
        let mut views = crate::index::rank_views(&walked, blocks, now).into_iter();
        let status = |member: &Member, mut views: Vec<crate::index::RankView>| {
            for view in &mut views {
                view.fallback = member.replica.status.rank_state(view.rank) == Some(StreamState::Fallback);
            }
            views
        };
        (ranks.iter().zip(members))
            .map(|(ranks, member)| ranks.and_then(|_| views.next()).map(|views| status(member, views)))
            .collect()
    }

    /// Scores every member for a request with the given blocks by `routing`; only a request
    /// to be sent (`send`) moves its policy on.
    fn score(
        &self,
        (routing, send): (&Arc<Routing>, bool),
        members: Vec<Member>,
        blocks: Arc<[BlockHash]>,
        all_blocks: Arc<[BlockHash]>,
        request: &RequestView,
        (first_prompt_tokens, adapter): (usize, Option<Adapter<'_>>),
    ) -> Plan {
        let states: Vec<StreamState> = members.iter().map(|m| m.replica.status.state()).collect();
        let (overlaps, credited) = self.index.lookup_with_credits(&blocks, |overlaps, credits| {
            let counted = |(m, state): (&Member, &StreamState)| match state {
                StreamState::Fallback => None,
                _ => Some((m.replica.id, overlaps.get(m.replica.id))),
            };
            credits.extend_each(&blocks, members.iter().zip(&states).map(counted))
        });
        // Each replica's run in host memory from where its cache (and credits) end: loaded
        // rather than computed. (None for a data-parallel replica: `ingest::stream`.)
        let offloaded = match self.host_index.is_empty() {
            true => Overlaps::new(),
            false => {
                let from: Vec<(ReplicaId, usize)> = (members.iter().zip(&states).zip(&credited))
                    .filter(|((_, state), _)| **state != StreamState::Fallback)
                    .map(|((m, _), &credited)| (m.replica.id, credited))
                    .collect();
                self.host_index.continue_from(&blocks, &from)
            }
        };
        let now = tokio::time::Instant::now();
        let rank_views = Self::rank_views(routing, &members, &blocks, now);
        let verdicts =
            verdicts_for(members.iter().map(|m| &*m.upstream), routing.max_in_flight_per_replica, adapter);
        let mut candidates: Vec<Scored> = members
            .into_iter()
            .zip(verdicts)
            .zip(states.into_iter().zip(credited))
            .zip(rank_views.into_iter().chain(std::iter::repeat_with(|| None)))
            .map(|(((member, ineligible), (state, credited_blocks)), rank_views)| {
                let indexed_blocks = match state {
                    StreamState::Fallback => 0,
                    _ => overlaps.get(member.replica.id),
                };
                // What the engine will reuse of it (vLLM recomputes an all-cached last block,
                // and with EAGLE a hit's last block).
                let reused = |blocks| {
                    member.replica.spec.engine.reused_blocks(
                        blocks,
                        first_prompt_tokens,
                        self.block_size,
                        self.eagle,
                    )
                };
                // A data-parallel replica offers what the rank the request is sent to holds.
                let (rank, offered, rank_load, rank_indexed) = match (&routing.ranks_by, rank_views) {
                    (Some(costs), Some(ranks)) => {
                        // Ties between ranks by the request and the replica's name (the
                        // request's key alone would repeat the replicas' tie, rank for replica
                        // id; ids are each router's own, names are every router's).
                        let name = member.replica.spec.name.as_bytes();
                        let key = xxhash_rust::xxh3::xxh3_64_with_seed(name, request.key);
                        let best = best_rank(costs, &RequestView { key, ..*request }, &ranks, reused);
                        let indexed =
                            |rank| ranks.iter().find(|v| v.rank == rank).map_or(0, |v| v.indexed_blocks);
                        best.map_or((None, 0, None, 0), |(rank, blocks, load)| {
                            (Some(rank), blocks, Some(load), indexed(rank))
                        })
                    }
                    _ => (None, credited_blocks, None, 0),
                };
                let held = match rank {
                    None => offered.max(offloaded.get(member.replica.id)),
                    Some(_) => offered,
                };
                let overlap = reused(held);
                let view = ReplicaView {
                    id: member.replica.id,
                    tie: member.replica.tie,
                    overlap_blocks: overlap,
                    offloaded_blocks: overlap - reused(offered),
                    load: member.upstream.load_at(now),
                    stream: PbState::from(state),
                    eligible: ineligible.is_none(),
                };
                let rank_blocks = if rank.is_some() { offered } else { 0 };
                Scored {
                    member,
                    view,
                    indexed_blocks,
                    credited_blocks,
                    cost: f64::INFINITY,
                    ineligible,
                    rank,
                    rank_blocks,
                    rank_indexed,
                    rank_load,
                }
            })
            .collect();
        // A replica whose stream is FALLBACK is taken to hold what every one with a stream
        // holds, as the cache-aware cost takes it: its predicted hit, and the prefill it is
        // charged with, follow (charged the whole prompt, it would look queued and starve).
        if candidates.iter().any(|c| c.view.stream == PbState::Fallback) {
            let common = policy::common_overlap(candidates.iter().map(|c| &c.view));
            for c in candidates.iter_mut().filter(|c| c.view.stream == PbState::Fallback) {
                c.view.overlap_blocks = common;
            }
        }
        let views: Vec<ReplicaView> = candidates.iter().map(|c| c.view).collect();
        let decision =
            if send { routing.policy.choose(request, &views) } else { routing.policy.peek(request, &views) };
        for (c, cost) in candidates.iter_mut().zip(decision.costs) {
            c.cost = cost;
        }
        let mut order = Vec::new();
        if let Some(i) = decision.chosen.filter(|&i| candidates.get(i).is_some_and(|c| c.view.eligible)) {
            order.push(i);
            order.extend((0..candidates.len()).filter(|&j| j != i && candidates[j].view.eligible));
            // Equal costs (the random policy's others, equal loads) are taken in the request's
            // rendezvous order, as the policies break ties: fleet order would send every
            // retry of a failed replica's traffic to the lowest id.
            let tie = |i: usize| std::cmp::Reverse(policy::rendezvous(request.key, candidates[i].view.tie));
            let by_cost = |&a: &usize, &b: &usize| {
                candidates[a].cost.total_cmp(&candidates[b].cost).then(tie(a).cmp(&tie(b)))
            };
            order[1..].sort_by(by_cost);
            // Then those without room now, the most of the prefix first (the policies cost
            // no ineligible replica): a retry waits for theirs when no other is left.
            let eligible = order.len();
            let saturated = |j: &usize| candidates[*j].ineligible == Some(Ineligible::Saturated);
            order.extend((0..candidates.len()).filter(saturated));
            let overlap = |i: usize| std::cmp::Reverse(candidates[i].view.overlap_blocks);
            order[eligible..].sort_by_key(|&i| (overlap(i), tie(i)));
        }
        Plan {
            routing: Arc::clone(routing),
            order,
            candidates,
            prompt_tokens: request.prompt_tokens as u64,
            blocks,
            all_blocks,
            first_prompt_tokens,
            block_size: self.block_size,
            max_tokens: None,
            unhashed_tokens: None,
            hold: None,
            load: None,
            keeps_response: super::responses::Keeps::Nothing,
            sequences: 1,
            prompts: 1,
            listed: false,
            choices: 1,
            streams: false,
            request: *request,
            model: None,
            prefilled_by: None,
            counted: true,
            hop: Hop::Whole,
            disaggregated: false,
        }
    }
}

/// The rank of `ranks` to send `request` to, with the blocks it holds of it (index and
/// credits): the least cache-aware cost over the ranks' overlaps (as the engine reuses them)
/// and the load on each (this router's sequences in flight there, and the others' work the
/// replica reports on it); between equals, `request.key`'s rendezvous
/// hash (the caller's key names the replica too, as every router names it, so that routers in
/// front of the same replica agree on a new prefix's rank).
fn best_rank(
    costs: &policy::CacheAware,
    request: &RequestView,
    ranks: &[crate::index::RankView],
    reused: impl Fn(usize) -> usize,
) -> Option<(u32, usize, policy::Load)> {
    let views: Vec<ReplicaView> = ranks
        .iter()
        .map(|r| ReplicaView {
            id: ReplicaId(r.rank),
            tie: u64::from(r.rank),
            overlap_blocks: reused(r.overlap_blocks),
            offloaded_blocks: 0,
            load: policy::Load {
                in_flight: r.in_flight,
                others: r.others,
                pending_prefill_tokens: r.pending_prefill_tokens,
                recent_prompt_tokens: r.recent_prompt_tokens,
                ..policy::Load::default()
            },
            stream: PbState::Exact,
            eligible: !r.fallback,
        })
        .collect();
    let chosen = costs.choose(request, &views).chosen?;
    Some((ranks[chosen].rank, ranks[chosen].overlap_blocks, views[chosen].load))
}

/// The 503 of a request no replica could take: [`ProxyError::Saturated`] when one of them
/// could once it has room (the request may wait for it: [`super::queue`]).
fn unavailable(plan: &Plan) -> ProxyError {
    if plan.candidates.is_empty() {
        let none = match plan.hop {
            Hop::Whole if plan.disaggregated => super::disagg::NO_DECODER,
            Hop::Whole => "no replicas are configured",
            Hop::Roomless => super::disagg::NO_ROOMLESS,
            Hop::Prefill(_) => "no other replica prefills",
            Hop::Bootstrap => "no SGLang replica of role prefill",
        };
        return ProxyError::Unavailable(none.into());
    }
    let reasons: Vec<String> = plan
        .candidates
        .iter()
        .map(|c| {
            format!(
                "{}: {}",
                c.member.replica.spec.name,
                c.ineligible.map_or("not chosen", Ineligible::as_str)
            )
        })
        .collect();
    let reason = reasons.join(", ");
    let saturated = plan.candidates.iter().filter(|c| c.ineligible == Some(Ineligible::Saturated));
    let replicas: Vec<ReplicaId> = saturated.map(|c| c.member.replica.id).collect();
    match replicas.is_empty() {
        true => ProxyError::Unavailable(reason),
        false => ProxyError::Saturated { reason, replicas },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::RankView;

    /// Ranks holding `overlaps` blocks with `in_flight` sequences each: the rank chosen for a
    /// 512-token request (block size 16, so 32 blocks) and its overlap.
    fn chosen(overlaps: &[usize], in_flight: &[u32], key: u64) -> Option<(u32, usize)> {
        let request = RequestView { prompt_tokens: 512, blocks: 32, block_size: 16, key };
        let ranks: Vec<RankView> = (0..overlaps.len())
            .map(|r| RankView {
                rank: r as u32,
                overlap_blocks: overlaps[r],
                in_flight: in_flight[r],
                ..RankView::default()
            })
            .collect();
        best_rank(&policy::CacheAware::default(), &request, &ranks, |blocks| blocks)
            .map(|(rank, blocks, _)| (rank, blocks))
    }

    /// Between ranks holding as much, the one with less prefill queued, or fewer tokens sent
    /// lately, takes the request.
    #[test]
    fn ranks_are_weighed_on_pending_prefill_and_recent_tokens() {
        let request = RequestView { prompt_tokens: 512, blocks: 32, block_size: 16, key: 7 };
        let ranks = |pending: [u64; 2], recent: [u64; 2]| -> Vec<RankView> {
            (0..2)
                .map(|r| RankView {
                    rank: r as u32,
                    overlap_blocks: 8,
                    pending_prefill_tokens: pending[r],
                    recent_prompt_tokens: recent[r],
                    ..RankView::default()
                })
                .collect()
        };
        let best = |views: &[RankView]| {
            best_rank(&policy::CacheAware::default(), &request, views, |b| b)
                .map(|(rank, blocks, _)| (rank, blocks))
        };
        assert_eq!(best(&ranks([4096, 0], [0, 0])), Some((1, 8)));
        assert_eq!(best(&ranks([0, 4096], [0, 0])), Some((0, 8)));
        assert_eq!(best(&ranks([0, 0], [30_000, 10_000])), Some((1, 8)));
        assert_eq!(best(&ranks([0, 0], [10_000, 30_000])), Some((0, 8)));
    }

    /// A rank whose stream is FALLBACK is not named, whatever it seemed to hold; with none
    /// followed, none is.
    #[test]
    fn a_fallback_rank_is_not_named() {
        let request = RequestView { prompt_tokens: 512, blocks: 32, block_size: 16, key: 7 };
        let view = |rank: u32, overlap_blocks, fallback| RankView {
            rank,
            overlap_blocks,
            fallback,
            ..RankView::default()
        };
        let best = |views: &[RankView]| {
            best_rank(&policy::CacheAware::default(), &request, views, |b| b)
                .map(|(rank, blocks, _)| (rank, blocks))
        };
        assert_eq!(best(&[view(0, 2, false), view(1, 8, true)]), Some((0, 2)));
        assert_eq!(best(&[view(0, 2, true), view(1, 8, true)]), None);
    }

    #[test]
    fn the_rank_holding_more_of_the_prefix_takes_it() {
        assert_eq!(chosen(&[1, 8], &[0, 0], 7), Some((1, 8)));
        assert_eq!(chosen(&[8, 1], &[0, 0], 7), Some((0, 8)));
    }

    #[test]
    fn a_prefix_every_rank_holds_goes_by_load() {
        // A system prompt on both ranks: the one with less in flight.
        assert_eq!(chosen(&[2, 2], &[3, 0], 7), Some((1, 2)));
        assert_eq!(chosen(&[2, 2], &[0, 3], 7), Some((0, 2)));
        // Two blocks more (128 tokens' cost at miss weight 4) do not outweigh three
        // sequences more (64 each).
        assert_eq!(chosen(&[2, 4], &[0, 3], 7), Some((0, 2)));
    }

    #[test]
    fn a_new_prefix_goes_by_load_then_by_its_key() {
        assert_eq!(chosen(&[0, 0, 0], &[1, 0, 1], 7), Some((1, 0)));
        // Equal loads: the request's rendezvous hash, the same each time, and not always the
        // same rank for every request.
        let ranks: std::collections::HashSet<u32> =
            (0..32).map(|key| chosen(&[0, 0, 0], &[0, 0, 0], key).unwrap().0).collect();
        assert_eq!(chosen(&[0, 0, 0], &[0, 0, 0], 5), chosen(&[0, 0, 0], &[0, 0, 0], 5));
        assert_eq!(ranks.len(), 3, "new prefixes spread over the ranks");
    }
}
