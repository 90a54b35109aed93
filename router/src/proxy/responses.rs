//! OpenAI's Responses API (`/v1/responses`), which vLLM serves with a store of its own in
//! each server process (with `VLLM_ENABLE_RESPONSES_API_STORE=1`): a response can be
//! continued (`previous_response_id`), fetched (`GET /v1/responses/{id}`) or cancelled
//! (`POST /v1/responses/{id}/cancel`) only on the replica that made it.
//!
//! - A new conversation (`POST /v1/responses` without `previous_response_id`) is routed on
//!   its prompt like a chat: the router reads it as the chat request vLLM makes of it
//!   (`kvroute_proto::openai::request::responses`).
//! - A request about a stored response goes to the replica that made it, whatever its load
//!   (only it can answer), with no retry elsewhere; a continuation, to the data-parallel rank
//!   this router sent the response's request to (its conversation's blocks are there). Its prompt starts with a conversation only
//!   that replica has, so it counts in neither hit rate.
//! - The router learns which replica made a response (one that asked to be kept: `store`
//!   true or absent) from the response itself: the first
//!   `"id"` of a successful answer's body (vLLM writes the response object's `id` first, and
//!   a stream's first event is `response.created` with the response inside, its `id`
//!   first). The map is bounded ([`Owners`]); an id the router does not know (another
//!   router's, one from before a restart, or one it has let go) is asked of every replica
//!   (`GET /v1/responses/{id}`) and the one that has it remembered.
//! - An id no replica has gets vLLM's own answer: 404, `Response with id '…' not found.`,
//!   and for [`MISSING_FOR`] after that the same answer without the replicas asked again.
//! - A continuation's body is sent whole (on a pooled connection), once. What it adds to the
//!   stored conversation (its instructions and input) is tokenized as a chat of its own
//!   ([`Continuation`]): that is held to `--max-prompt-tokens` (the whole prompt is longer
//!   still) and its `max_output_tokens` to `--max-completion-tokens`, and counts as the
//!   owner's load, less what the owner is shown to hold of it (the instructions, usually).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::join_all;
use http::{Method, StatusCode};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};

use super::error::ProxyError;
use super::pool::Pool;
use super::route::{Decider, Plan, RequestLimits};
use crate::fleet::{Fleet, Member};
use crate::metrics::{OutcomeLabel, ProxyMetrics};
use kvroute_proto::openai::Endpoint;
use kvroute_proto::openai::request::responses::{Responses, asks_to_store, runs_in_background};

pub use kvroute_proto::openai::request::responses::RESPONSES_PATH;

/// Most bytes of a response's beginning searched for its id.
pub(super) const ID_WITHIN: usize = 4096;

/// What a request under `/v1/responses` is.
#[derive(Debug, PartialEq, Eq)]
pub enum Target<'a> {
    /// `POST /v1/responses`: a new response.
    Create,
    /// `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` (and anything else under
    /// an id): about a stored response.
    Stored(&'a str),
}

/// What `path` asks of the Responses API, if it is under it.
pub fn target(path: &str) -> Option<Target<'_>> {
    let rest = path.strip_prefix(RESPONSES_PATH)?;
    if rest.is_empty() {
        return Some(Target::Create);
    }
    let id = rest.strip_prefix('/')?.split('/').next()?;
    (!id.is_empty()).then_some(Target::Stored(id))
}

/// What a Responses request's replica keeps of its answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Keeps {
    /// Nothing: not a Responses request, or one whose response is not to be kept.
    #[default]
    Nothing,
    /// Its response: the answer's id is learned ([`Owners`]).
    Response,
    /// Its response, generated in the background (`background: true`): the request's places
    /// are held until the response is final ([`super::background`]).
    Background,
}

impl Keeps {
    /// What a Responses request's `body` asks to be kept. A malformed `store` or `background`
    /// is the replica's to refuse; until then, its id is worth keeping, and its places holding
    /// (a replica that answers it at once shows it final at the first ask).
    pub fn asked_in(body: &[u8]) -> Keeps {
        match (asks_to_store(body).unwrap_or(true), runs_in_background(body).unwrap_or(true)) {
            (false, _) => Keeps::Nothing,
            (true, false) => Keeps::Response,
            (true, true) => Keeps::Background,
        }
    }

    /// Whether the response is kept.
    pub fn any(self) -> bool {
        self != Keeps::Nothing
    }
}

/// Whether a request about a stored response is a short one: `GET /v1/responses/{id}` without
/// `stream` (a resumed stream lasts as long as the generation), or its cancel. Those about a
/// response the router knows take no place under its limits ([`super::background`]).
pub fn asks_briefly(method: &Method, uri: &http::Uri) -> bool {
    let Some(Target::Stored(_)) = target(uri.path()) else { return false };
    // As FastAPI reads a boolean query parameter; anything but a false word streams.
    let streams = || {
        form_urlencoded::parse(uri.query().unwrap_or_default().as_bytes())
            .filter(|(name, _)| name == "stream")
            .last()
            .is_some_and(|(_, value)| {
                !matches!(&*value.to_ascii_lowercase(), "0" | "false" | "off" | "no" | "f" | "n")
            })
    };
    match *method {
        Method::GET | Method::HEAD => !streams(),
        Method::POST => uri.path().ends_with("/cancel"),
        _ => false,
    }
}

/// A Responses request that continues a stored response (`previous_response_id`).
#[derive(Debug)]
pub struct Continuation {
    /// The stored response's id.
    pub id: String,
    /// What it asks to be kept of its own response.
    pub store: Keeps,
    /// Its place among requests waiting for room (vLLM's `priority`).
    pub priority: i64,
    /// What the request adds to the stored conversation, decided as a chat of its own with
    /// nothing credited or counted; `None` when that chat cannot be rendered or tokenized:
    /// the request goes without an estimate of its load.
    added: Option<Plan>,
}

impl Continuation {
    /// Reads a continuation's `body`, refusing one beyond `limits`.
    ///
    /// Its new turn alone is not what the replica renders (the stored conversation goes
    /// before it), and a template may refuse it where it takes the whole (a turn of tool
    /// outputs with no user message, roles that do not alternate, no message at all): that
    /// is no reason to refuse the request, only to go without the estimate.
    pub async fn read(decider: &Decider, body: &[u8], limits: &RequestLimits) -> Result<Self, ProxyError> {
        let request = Responses::read_as(body, decider.prompts.tokenization().is_harmony())?;
        limits.check_completion(request.max_output_tokens()?, Endpoint::Responses)?;
        let priority = request.priority()?;
        let id = request.previous_response_id.as_deref().unwrap_or_default().to_owned();
        let added = match decider.explain(Endpoint::ChatCompletions, &request.chat_body(&[])).await {
            Ok(plan) => {
                limits.check(&plan, Endpoint::Responses)?;
                Some(plan)
            }
            Err(e) => {
                tracing::debug!(error = %e, "a continuation's new turn alone could not be tokenized");
                None
            }
        };
        Ok(Continuation { id, store: Keeps::asked_in(body), priority, added })
    }

    /// Its load on `owner`: prompt tokens (at least: the new ones), and those of them `owner`
    /// is to prefill (the stored conversation is cached there, having just been made there).
    pub fn load_on(&self, owner: &Member) -> (u64, u64) {
        self.added
            .as_ref()
            .map_or((0, 0), |plan| (plan.prompt_tokens, plan.prefill_tokens_on(owner.replica.id)))
    }
}

/// How long an id every replica said it lacks gets the 404 without the replicas asked
/// again: a client that repeats a stale id costs the fleet one round of asking in that time,
/// not one a request. Short, for a response that is kept only once it is done (vLLM keeps a
/// streamed one at its end) and was asked for before.
pub const MISSING_FOR: Duration = Duration::from_secs(2);

/// Most ids remembered as missing.
const MISSING_IDS: usize = 4096;

/// The longest id remembered, owned or missing: one an engine could have made (vLLM's are
/// `resp_` and 32 hex digits). A replica's answer may hold an id up to [`ID_WITHIN`] long,
/// and `--response-owners` bounds the ids remembered, not their bytes.
const MAX_ID_BYTES: usize = 256;

/// Which replica made each response the router has seen (by replica name), bounded.
#[derive(Debug)]
pub struct Owners {
    map: quick_cache::sync::Cache<Box<str>, Owner>,
    /// Ids every replica said it lacks, and when ([`MISSING_FOR`]).
    missing: quick_cache::sync::Cache<Box<str>, Instant>,
    /// Ids the replicas are being asked for: a lookup of one waits for the one under way and
    /// reads its answer, rather than asking every replica again. (The gate holds whether a
    /// lookup got every replica's answer: one whose client left before did not.)
    asking: std::sync::Mutex<std::collections::HashMap<Box<str>, Gate>>,
}

/// The replica that made a response, and the data-parallel rank the router sent its request
/// to (which holds the conversation's prefix), if it named one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    pub replica: Arc<str>,
    pub rank: Option<u32>,
}

impl Owner {
    pub fn new(replica: impl Into<Arc<str>>, rank: Option<u32>) -> Self {
        Owner { replica: replica.into(), rank }
    }
}

/// Held by the lookup of an id asking the replicas; it says whether one got their answers.
type Gate = Arc<tokio::sync::Mutex<bool>>;

/// A lookup's turn to ask the replicas for an id; the id is forgotten with the last turn.
struct Turn<'a> {
    owners: &'a Owners,
    id: &'a str,
    gate: Gate,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut asking = self.owners.asking.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // The map's and this turn's: nobody else waits.
        if Arc::strong_count(&self.gate) <= 2 {
            asking.remove(self.id);
        }
    }
}

impl Owners {
    /// A map of at most `capacity` responses. Most of it is for new ids: the cache's default
    /// keeps 97% for ids read again, and a conversation's id is read once, by its next turn,
    /// so new ids would share the other 3% and go before their next turn came.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        let options = quick_cache::OptionsBuilder::new()
            .estimated_items_capacity(capacity)
            .weight_capacity(capacity as u64)
            .hot_allocation(0.05)
            .build();
        let map = match options {
            Ok(options) => quick_cache::sync::Cache::with_options(
                options,
                Default::default(),
                Default::default(),
                Default::default(),
            ),
            Err(_) => quick_cache::sync::Cache::new(capacity),
        };
        Owners { map, missing: quick_cache::sync::Cache::new(MISSING_IDS), asking: Default::default() }
    }

    pub fn learn(&self, id: &str, owner: &Owner) {
        if id.len() > MAX_ID_BYTES {
            return;
        }
        self.map.insert(id.into(), owner.clone());
        if !self.missing.is_empty() {
            self.missing.remove(id);
        }
    }

    /// Whether every replica said it lacks `id` less than [`MISSING_FOR`] before `now`.
    fn known_missing(&self, id: &str, now: Instant) -> bool {
        self.missing.get(id).is_some_and(|since| now.saturating_duration_since(since) < MISSING_FOR)
    }

    pub fn owner(&self, id: &str) -> Option<Owner> {
        self.map.get(id)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The replica that made response `id` (as the replicas read it: percent-decoded): the
    /// one the router knows, with the rank it sent the request to if that rank is still the
    /// replica's, else the one that answers for it when every replica is asked (with no
    /// rank: the store is the API server's, whichever rank ran it), `headers` being the
    /// client's, so a replica's API key is given. A 404 when every
    /// replica answered that it does not have it; a 503 when one did not answer, which may
    /// be the one that has it.
    pub async fn find(
        &self,
        fleet: &Fleet,
        pool: &Arc<Pool>,
        id: &str,
        headers: &http::HeaderMap,
        (timeout, metrics): (Duration, &ProxyMetrics),
    ) -> Result<(Member, Option<u32>), ProxyError> {
        let count = |outcome| metrics.response_lookups.get_or_create(&OutcomeLabel { outcome }).inc();
        let known = || {
            if let Some((owner, member)) =
                self.owner(id).and_then(|owner| fleet.member(&owner.replica).map(|member| (owner, member)))
            {
                count("known");
                let ranks = member.replica.ranks.get().map_or(0, |ranks| ranks.len());
                let rank = owner.rank.filter(|rank| *rank < ranks);
                return Some(Ok((member, rank)));
            }
            // An empty id names nothing (a replica would redirect `/v1/responses/` instead).
            if id.is_empty() || self.known_missing(id, Instant::now()) {
                count("known_missing");
                return Some(Err(not_found(id)));
            }
            None
        };
        if let Some(known) = known() {
            return known;
        }
        // One lookup of an id at a time: the next reads what this one learns.
        let turn = {
            let mut asking = self.asking.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            Turn { owners: self, id, gate: asking.entry(id.into()).or_default().clone() }
        };
        let mut asked = match turn.gate.try_lock() {
            Ok(held) => held,
            Err(_) => {
                count("waited");
                let held = turn.gate.lock().await;
                match known() {
                    Some(known) => return known,
                    // Anything else (a replica that did not answer in time, every one
                    // refusing) would cost this request as long again, after the wait: it gets
                    // the 503 a retry can act on.
                    None if *held => {
                        return Err(ProxyError::Unavailable(format!(
                            "response '{id}' was just sought on every replica for another request, \
                             and none said it has it"
                        )));
                    }
                    // The lookup it waited for was given up before the replicas answered (its
                    // client left): this one asks them.
                    None => held,
                }
            }
        };
        // Not asked until this lookup has its answers: a lookup after this one, given up
        // before them, must not leave the one waiting behind it a 503 (the gate said "asked"
        // from a lookup done before either took it).
        *asked = false;
        let members = fleet.members();
        let segment = utf8_percent_encode(id, SEGMENT).to_string();
        let asks = members.iter().map(|member| {
            let url = format!("{}{RESPONSES_PATH}/{segment}", member.replica.spec.http_url);
            async move {
                let uri: http::Uri = url.parse().ok()?;
                let ask = async {
                    let empty = super::http1::Outgoing::Full(bytes::Bytes::new());
                    let response = pool.send_head(&Method::GET, &uri, headers, empty).await.ok()?;
                    let status = response.status();
                    // The replica that has it: its status says so, and its body (the whole
                    // response, maybe long) is dropped, with its connection. Another answer is
                    // read to its end (a short error), so the connection goes back to the pool.
                    if status == StatusCode::OK {
                        return Some((status, bytes::Bytes::new()));
                    }
                    let body = super::body::read_at_most(response.into_body(), 64 << 10).await.ok()?;
                    Some((status, body))
                };
                tokio::time::timeout(timeout, ask).await.ok()?
            }
        });
        let answers = join_all(asks).await;
        *asked = true;
        let first = answers.first().and_then(|a| a.as_ref());
        let answers: Vec<Option<StatusCode>> = answers.iter().map(|a| a.as_ref().map(|(s, _)| *s)).collect();
        let found = answers.iter().position(|a| *a == Some(StatusCode::OK));
        match found {
            Some(at) => {
                let member = members.into_iter().nth(at).ok_or_else(|| not_found(id))?;
                self.learn(id, &Owner::new(member.replica.spec.name.as_str(), None));
                count("found");
                Ok((member, None))
            }
            // Its known owner is out of the fleet (discovery dropped it a while, an upsert is
            // under way): it may still have it, so not a definite 404.
            None if let Some(owner) = self.owner(id) => {
                count("owner_gone");
                Err(ProxyError::Unavailable(format!(
                    "response '{id}' was stored by replica {}, which is not in the fleet now",
                    owner.replica
                )))
            }
            None if !answers.is_empty() && answers.iter().all(|a| *a == Some(StatusCode::NOT_FOUND)) => {
                count("missing");
                // A client's id of any length would be kept: only one an engine could have made.
                if id.len() <= MAX_ID_BYTES {
                    self.missing.insert(id.into(), Instant::now());
                }
                Err(not_found(id))
            }
            // Refused alike everywhere, for another reason (a wrong API key, say): the client's
            // to fix, not the router's to retry.
            None if let Some((status, said)) = first.filter(|(s, _)| s.is_client_error())
                && answers.iter().all(|a| *a == Some(*status)) =>
            {
                count("refused");
                Err(ProxyError::RefusedEverywhere {
                    status: *status,
                    said: String::from_utf8_lossy(said).trim().chars().take(512).collect(),
                })
            }
            None => {
                count("unanswered");
                Err(ProxyError::Unavailable(format!(
                    "response '{id}' is on no replica that answered, and {} of {} did not say they lack it",
                    answers.iter().filter(|a| **a != Some(StatusCode::NOT_FOUND)).count(),
                    answers.len()
                )))
            }
        }
    }
}

/// What is percent-encoded in a path segment: everything but RFC 3986's unreserved.
pub(super) const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');

/// vLLM's answer for a response id no replica has.
fn not_found(id: &str) -> ProxyError {
    ProxyError::UnknownResponse(id.to_owned())
}

/// The id in a `/v1/responses/{id}` path segment, as the replica's server reads it.
pub fn decoded(segment: &str) -> String {
    percent_decode_str(segment).decode_utf8_lossy().into_owned()
}

/// Finds the id at the beginning of a response body, frame by frame, and tells [`Owners`].
pub struct Learner {
    owners: Arc<Owners>,
    owner: Owner,
    seen: Vec<u8>,
    learned: Option<Box<str>>,
}

impl Learner {
    pub fn new(owners: Arc<Owners>, owner: Owner) -> Self {
        Learner { owners, owner, seen: Vec::new(), learned: None }
    }

    /// The id learned, once it was, and the replica that has the response.
    pub fn learned(&self) -> Option<(&str, &Arc<str>)> {
        Some((self.learned.as_deref()?, &self.owner.replica))
    }

    /// Takes the next data frame; whether it wants more.
    pub fn feed(&mut self, data: &[u8]) -> bool {
        let found = if self.seen.is_empty() {
            first_id(data)
        } else {
            self.seen.extend_from_slice(&data[..data.len().min(ID_WITHIN - self.seen.len())]);
            first_id(&self.seen)
        };
        match found {
            Some(Ok(id)) => {
                if let Ok(id) = std::str::from_utf8(id) {
                    self.owners.learn(id, &self.owner);
                    self.learned = Some(id.into());
                }
                false
            }
            Some(Err(())) => false,
            None if self.seen.is_empty() && data.len() < ID_WITHIN => {
                self.seen.extend_from_slice(data);
                true
            }
            None => self.seen.len() < ID_WITHIN && !self.seen.is_empty(),
        }
    }
}

/// The value of the first `"id"` key in `json`: `Some(Err)` when it is not a plain string
/// (or none is within [`ID_WITHIN`] bytes), `None` when more bytes are needed.
pub(super) fn first_id(json: &[u8]) -> Option<Result<&[u8], ()>> {
    let json = &json[..json.len().min(ID_WITHIN)];
    let mut from = 0;
    // The first `"id"` that is a key (a value `"id"` is passed over).
    let value = loop {
        let Some(at) = memchr::memmem::find(&json[from..], b"\"id\"") else {
            return (json.len() >= ID_WITHIN).then_some(Err(()));
        };
        from += at + 4;
        let rest = json[from..].trim_ascii_start();
        match rest.first()? {
            b':' => break rest[1..].trim_ascii_start(),
            _ => continue,
        }
    };
    let value = match value.first()? {
        b'"' => &value[1..],
        _ => return Some(Err(())),
    };
    let end = memchr::memchr2(b'"', b'\\', value)?;
    match value[end] {
        b'"' if end > 0 => Some(Ok(&value[..end])),
        _ => Some(Err(())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_a_new_response_or_a_stored_one() {
        assert_eq!(target("/v1/responses"), Some(Target::Create));
        assert_eq!(target("/v1/responses/resp_1"), Some(Target::Stored("resp_1")));
        assert_eq!(target("/v1/responses/resp_1/cancel"), Some(Target::Stored("resp_1")));
        assert_eq!(target("/v1/responses/"), None);
        assert_eq!(target("/v1/responsesx"), None);
        assert_eq!(target("/v1/chat/completions"), None);
    }

    /// A short request about a stored response (no resumed stream) takes no place.
    #[test]
    fn fetching_without_a_stream_and_cancelling_are_brief() {
        let brief = |method: Method, uri: &str| asks_briefly(&method, &uri.parse().unwrap());
        assert!(brief(Method::GET, "/v1/responses/resp_1"));
        assert!(brief(Method::GET, "/v1/responses/resp_1?stream=false&starting_after=3"));
        assert!(brief(Method::POST, "/v1/responses/resp_1/cancel"));
        assert!(!brief(Method::GET, "/v1/responses/resp_1?stream=true"));
        assert!(!brief(Method::GET, "/v1/responses/resp_1?stream=false&stream=1"), "the last counts");
        assert!(!brief(Method::POST, "/v1/responses/resp_1"));
        assert!(!brief(Method::POST, "/v1/responses"), "a new response");
        assert!(!brief(Method::GET, "/v1/models"));
    }

    #[test]
    fn the_first_id_is_found_in_json_and_in_a_stream() {
        let json = br#"{"id":"resp_0a1b","created_at":1,"output":[{"id":"msg_2"}]}"#;
        assert_eq!(first_id(json), Some(Ok(&b"resp_0a1b"[..])));
        let sse = b"event: response.created\ndata: {\"response\":{\"id\": \"resp_9\",\"x\":1},\"type\":\"response.created\"}\n\n";
        assert_eq!(first_id(sse), Some(Ok(&b"resp_9"[..])));
        assert_eq!(first_id(br#"{"id":"res"#), None, "cut before the value ends");
        assert_eq!(first_id(br#"{"i"#), None);
        assert_eq!(first_id(br#"{"id":7}"#), Some(Err(())));
        assert_eq!(
            first_id(br#"{"kind":"id","id":"resp_2"}"#),
            Some(Ok(&b"resp_2"[..])),
            "a value is no key"
        );
        assert_eq!(first_id(br#"{"id":"a\"b"}"#), Some(Err(())));
    }

    #[test]
    fn an_id_split_across_frames_is_learned() {
        let owners = Arc::new(Owners::new(16));
        let mut learner = Learner::new(owners.clone(), Owner::new("replica-1", Some(1)));
        assert!(learner.feed(b"event: response.created\ndata: {\"response\":{\"i"));
        assert!(learner.feed(b"d\":\"resp_"));
        assert!(!learner.feed(b"77\",\"status\":\"in_progress\"}}\n\n"));
        assert_eq!(owners.owner("resp_77"), Some(Owner::new("replica-1", Some(1))));
        let mut no_id = Learner::new(owners.clone(), Owner::new("replica-2", None));
        let error = br#"{"error":{"message":"bad","type":"invalid_request_error","param":null,"code":400}}"#;
        assert!(no_id.feed(error), "it cannot know yet that no id follows");
        assert!(!no_id.feed(&[b' '; ID_WITHIN]), "but it gives up past the bound");
        assert_eq!(owners.len(), 1);
    }

    #[test]
    fn an_id_is_known_missing_for_a_while_and_not_once_learned() {
        let owners = Owners::new(16);
        let then = Instant::now();
        owners.missing.insert("resp_late".into(), then);
        assert!(owners.known_missing("resp_late", then + MISSING_FOR / 2));
        assert!(!owners.known_missing("resp_late", then + MISSING_FOR), "only for a while");
        assert!(!owners.known_missing("resp_other", then));
        owners.learn("resp_late", &Owner::new("replica-1", None));
        assert!(!owners.known_missing("resp_late", then));
        assert!(owners.missing.get("resp_late").is_none());
        assert_eq!(owners.owner("resp_late"), Some(Owner::new("replica-1", None)));
    }

    /// `--response-owners` bounds what is remembered: past it, older ids give way.
    #[test]
    fn the_owners_remembered_are_bounded() {
        let owners = Owners::new(4);
        for i in 0..100 {
            owners.learn(&format!("resp_{i}"), &Owner::new("replica-1", None));
        }
        assert!((1..=4).contains(&owners.len()), "{} remembered", owners.len());
        assert_eq!(owners.owner("resp_99"), Some(Owner::new("replica-1", None)), "the newest is kept");
        // Nor are ids no engine makes: each could be 4 KiB, and the bound is of ids.
        let long = format!("resp_{}", "0".repeat(MAX_ID_BYTES));
        owners.learn(&long, &Owner::new("replica-1", None));
        assert_eq!(owners.owner(&long), None);
    }
}
