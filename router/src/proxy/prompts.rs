//! Turning a request into the token ids the replica will see, by one of three means:
//! - **local** (default): the shared `kvroute_proto::openai::Tokenization` with the
//!   built-in tokenizer or a HuggingFace `tokenizer.json` + chat template, rendered exactly
//!   as the replica renders it;
//! - **remote**: ask a replica's vLLM-style `POST /tokenize` (prompt or messages), with a
//!   small cache of recent answers, for models whose template the router cannot render. The
//!   replicas that are up (and have the request's LoRA adapter, as its routing reads it) take
//!   turns by prompt (so no one replica tokenizes for the whole fleet; see
//!   [`super::upstream::verdicts_for`], busy ones included); when one fails, times out or
//!   answers a 404 of vLLM's (no such model there), the next is asked, up to
//!   [`TOKENIZE_ATTEMPTS`] in all;
//! - token-id prompts skip tokenization in both.
//!
//! A chat with media (images, audio: [`ChatRequest::first_media`]) is routed on what is certain
//! of its tokens, the conversation before its first media
//! ([`Tokenization::partial_chat_tokens`]; nothing in remote mode), and its load counts its
//! text tokens: what the media become is up to the replica's model.
//!
//! Either way the cache namespace (model, LoRA adapter, `cache_salt`) comes from the local
//! `Tokenization`, so hashes match the replica's.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvroute_proto::CacheNamespace;
use kvroute_proto::openai::{
    ChatOptions, ChatRequest, Endpoint, InlineSystem, ParsedRequest, PartialPrompt, RequestError,
    Tokenization, Truncation,
};
use xxhash_rust::xxh3::xxh3_64;

use super::body::full;
use super::control::Client;
use super::upstream::{Adapter, verdicts_for};
use crate::fleet::Member;

/// Answers kept by the remote tokenizer's cache, and the token bytes they may hold together
/// (a replica's `/tokenize` takes prompts past any context length: without a byte bound,
/// 4096 long ones held gigabytes).
const REMOTE_CACHE_ENTRIES: usize = 4096;
const REMOTE_CACHE_BYTES: usize = 64 << 20;
/// Replicas asked for one prompt's tokens before the request fails.
pub const TOKENIZE_ATTEMPTS: usize = 3;

/// How the router gets token ids.
pub enum Prompts {
    Local(Arc<Tokenization>),
    Remote(Box<RemoteTokenizer>),
}

/// What the decision path needs from a request.
pub struct PromptInfo {
    pub namespace: CacheNamespace,
    /// One token list per prompt; for a chat with media, what is certain of its beginning.
    pub tokens: Vec<Vec<u32>>,
    /// For a chat with media, its text tokens beyond its certain beginning (known to follow
    /// `tokens`, but not which they are); `None` when every token is known.
    pub unhashed_tokens: Option<usize>,
}

impl PromptInfo {
    /// The namespace and tokens of `request`, tokenized by `t`.
    fn local(t: &Tokenization, request: &mut ParsedRequest<'_>) -> Result<Self, RequestError> {
        let namespace = t.namespace(request);
        if let Some(chat) = media_chat(request) {
            let partial = t.partial_chat_tokens(chat)?;
            let unhashed_tokens = Some(partial.text_tokens.saturating_sub(partial.tokens.len()));
            return Ok(Self { namespace, tokens: vec![partial.tokens], unhashed_tokens });
        }
        Ok(Self { namespace, tokens: t.take_prompt_tokens(request)?, unhashed_tokens: None })
    }
}

/// `request` if it is a chat with media.
fn media_chat<'r, 'a>(request: &'r ParsedRequest<'a>) -> Option<&'r ChatRequest<'a>> {
    match request {
        ParsedRequest::Chat(chat) if chat.first_media().is_some() => Some(chat),
        _ => None,
    }
}

impl Prompts {
    /// Whether the replicas tokenize (`--remote-tokenize`).
    pub fn is_remote(&self) -> bool {
        matches!(self, Prompts::Remote(_))
    }

    /// Where a Messages request's inline system messages go: as the local chat template's
    /// probe says, or folded once the replicas were seen to want them so (remote mode).
    pub fn inline_system(&self) -> InlineSystem {
        match self {
            Prompts::Remote(r) if r.folds_inline_system.load(Relaxed) => InlineSystem::Fold,
            prompts => prompts.tokenization().inline_system(),
        }
    }

    /// The replicas took a Messages conversation only with its inline system messages folded.
    pub fn saw_replicas_fold(&self) {
        if let Prompts::Remote(r) = self {
            r.folds_inline_system.store(true, Relaxed);
        }
    }

    /// The tokenization that names the cache namespace (and tokenizes, when local).
    pub fn tokenization(&self) -> &Tokenization {
        match self {
            Prompts::Local(t) => t,
            Prompts::Remote(r) => &r.local,
        }
    }

    /// The namespace and token ids of `request`; in remote mode, `fleet`'s replicas are
    /// asked. Token-id prompts are moved out of `request`, not copied.
    pub async fn tokens(
        &self,
        request: &mut ParsedRequest<'_>,
        body: &[u8],
        (fleet, adapter): (&[Member], Option<Adapter<'_>>),
    ) -> Result<PromptInfo, PromptError> {
        match self {
            Prompts::Local(t) if text_bytes(request) >= BLOCKING_TEXT_BYTES => {
                // Long enough to hold up every other connection of this thread for a while
                // (a HuggingFace tokenizer takes milliseconds for tens of KiB): on the
                // blocking pool, from a copy of the body.
                let (t, body) = (t.clone(), body.to_vec());
                let endpoint = match request {
                    ParsedRequest::Completion(_) => Endpoint::Completions,
                    ParsedRequest::Chat(_) => Endpoint::ChatCompletions,
                };
                let tokenized = off_the_thread(&BLOCKING_TURNS, move || {
                    PromptInfo::local(&t, &mut ParsedRequest::parse(endpoint, &body)?)
                });
                Ok(tokenized.await??)
            }
            Prompts::Local(t) => Ok(PromptInfo::local(t, request)?),
            // Boxed: the remote exchange's future would otherwise make every request's
            // future larger (see `forward::first_byte`), local ones included.
            Prompts::Remote(r) => Box::pin(r.tokens(request, body, (fleet, adapter))).await,
        }
    }
}

/// `/tokenize` takes no `reasoning_effort`: it goes into `chat_template_kwargs` as vLLM's chat
/// endpoint puts it there (rewritten by the fleet's `--reasoning-effort-map`, with
/// `enable_thinking`, unless the kwargs set that). Nor does it read `tool_choice`: with
/// `--exclude-tools-when-tool-choice-none`, tools the chat endpoint would leave out are left
/// out of what is sent. Nor `documents`: the chat endpoint passes them to the template over
/// the kwargs' own, so they go there (a `null` leaves the kwargs' as they are).
fn chat_endpoint_options(body: &mut serde_json::Map<String, serde_json::Value>, options: &ChatOptions) {
    if options.exclude_tools_when_tool_choice_none && body.get("tool_choice").is_some_and(|c| c == "none") {
        body.remove("tools");
    }
    let documents = body.remove("documents").filter(|d| !d.is_null());
    let effort = match body.remove("reasoning_effort") {
        Some(serde_json::Value::String(effort)) => {
            Some(options.effort(Some(&effort)).unwrap_or_default().to_owned())
        }
        _ => None,
    };
    if documents.is_none() && effort.is_none() {
        return;
    }
    let kwargs = body.entry("chat_template_kwargs").or_insert_with(|| serde_json::json!({}));
    if kwargs.is_null() {
        *kwargs = serde_json::json!({});
    }
    let Some(kwargs) = kwargs.as_object_mut() else { return };
    if let Some(documents) = documents {
        kwargs.insert("documents".into(), documents);
    }
    if let Some(effort) = effort {
        kwargs.entry("enable_thinking").or_insert_with(|| (effort != "none").into());
        kwargs.insert("reasoning_effort".into(), effort.into());
    }
}

/// Requests with this many bytes of text or more are tokenized on the blocking pool (media
/// and token ids do not count).
const BLOCKING_TEXT_BYTES: usize = 256 << 10;

/// Turns on the blocking pool for tokenizing, one a core, shared by every HTTP thread.
static BLOCKING_TURNS: std::sync::LazyLock<tokio::sync::Semaphore> = std::sync::LazyLock::new(|| {
    tokio::sync::Semaphore::new(std::thread::available_parallelism().map_or(1, usize::from))
});

/// `work` done on the blocking pool in one of `turns` (at most a core's worth at once,
/// whatever the HTTP threads' pools allow), held until the work is done: a client that
/// leaves (this future dropped) does not stop it.
async fn off_the_thread<T: Send + 'static>(
    turns: &'static tokio::sync::Semaphore,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, PromptError> {
    let turn = turns.acquire().await.map_err(|e| PromptError::Tokenizing(e.to_string()))?;
    let done = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        work()
    });
    done.await.map_err(|e| PromptError::Tokenizing(e.to_string()))
}

/// Bytes of text `request` has to tokenize (token-id prompts need none; a chat's media are
/// not text).
fn text_bytes(request: &ParsedRequest<'_>) -> usize {
    match request {
        ParsedRequest::Completion(r) => r
            .prompt
            .inputs()
            .iter()
            .map(|p| match p {
                kvroute_proto::openai::PromptInput::Text(text) => text.len(),
                kvroute_proto::openai::PromptInput::Tokens(_) => 0,
            })
            .sum(),
        // Tool definitions and template options are rendered into the prompt too.
        ParsedRequest::Chat(chat) => {
            let raw = |r: Option<&serde_json::value::RawValue>| r.map_or(0, |r| r.get().len());
            chat.text_bytes() + raw(chat.tools) + raw(chat.chat_template_kwargs)
        }
    }
}

/// Why a request's tokens could not be had.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("remote tokenization failed: {0}")]
    Remote(String),
    /// Tokenizing on the blocking pool failed (it panicked, or the runtime is going away).
    #[error("tokenizing failed: {0}")]
    Tokenizing(String),
    /// The replica's `/tokenize` refused the prompt itself (400 or 422): the client's error.
    #[error("the replica's tokenizer refused the prompt: {0}")]
    Refused(String),
    /// Every replica asked answered `/tokenize` a 404 in an error's shape, OpenAI's or vLLM's
    /// and SGLang's older flat one (no such model, or adapter, there): what the first said.
    #[error("{0}")]
    NotServed(String),
}

/// `/tokenize` on a replica, with a bounded cache keyed by the request's prompt part.
pub struct RemoteTokenizer {
    local: Arc<Tokenization>,
    client: Client,
    timeout: Duration,
    cache: Mutex<Cache>,
    /// The cache keys' hash, keyed at random per process (SipHash, twice for 128 bits): a
    /// client cannot make its body's key another body's, and take over that body's answer.
    keys: (RandomState, RandomState),
    /// The replicas were seen to refuse a Messages conversation with its inline system
    /// messages in place and take it with them folded: later ones are folded from the start.
    folds_inline_system: AtomicBool,
    /// The special tokens the replicas' tokenizer adds to a text, asked when first needed.
    specials: tokio::sync::OnceCell<Vec<u32>>,
}

#[derive(Default)]
struct Cache {
    map: HashMap<u128, Arc<Vec<Vec<u32>>>>,
    order: VecDeque<u128>,
    /// Token bytes held.
    bytes: usize,
}

impl Cache {
    /// Keeps `tokens` under `key`, the oldest answers giving way to stay within
    /// [`REMOTE_CACHE_ENTRIES`] and [`REMOTE_CACHE_BYTES`]; an answer over a sixteenth of the
    /// bytes is not kept.
    fn keep(&mut self, key: u128, tokens: &[Vec<u32>]) {
        let cost = |tokens: &[Vec<u32>]| tokens.iter().map(|t| t.len() * 4).sum::<usize>();
        let bytes = cost(tokens);
        if bytes > REMOTE_CACHE_BYTES / 16 || self.map.contains_key(&key) {
            return;
        }
        while self.order.len() >= REMOTE_CACHE_ENTRIES || self.bytes + bytes > REMOTE_CACHE_BYTES {
            let Some(old) = self.order.pop_front() else { break };
            if let Some(gone) = self.map.remove(&old) {
                self.bytes -= cost(&gone);
            }
        }
        self.map.insert(key, Arc::new(tokens.to_vec()));
        self.order.push_back(key);
        self.bytes += bytes;
    }
}

impl RemoteTokenizer {
    pub fn new(local: Arc<Tokenization>, client: Client, timeout: Duration) -> Self {
        Self {
            local,
            client,
            timeout,
            cache: Mutex::default(),
            keys: (RandomState::new(), RandomState::new()),
            folds_inline_system: AtomicBool::new(false),
            specials: tokio::sync::OnceCell::new(),
        }
    }

    async fn tokens(
        &self,
        request: &ParsedRequest<'_>,
        body: &[u8],
        (fleet, adapter): (&[Member], Option<Adapter<'_>>),
    ) -> Result<PromptInfo, PromptError> {
        let namespace = self.local.namespace(request);
        if let Some(chat) = media_chat(request) {
            // vLLM's `/tokenize` would expand the media into placeholders whose blocks carry
            // the media's hash, which the router cannot compute: routed on load, its text
            // tokens estimated.
            let estimate = PartialPrompt::estimated(chat);
            return Ok(PromptInfo {
                namespace,
                tokens: vec![Vec::new()],
                unhashed_tokens: Some(estimate.text_tokens),
            });
        }
        // The endpoint is part of what a body means (the same bytes can carry both a
        // `prompt` and `messages`), and so is the day: a chat template may print the date
        // (`strftime_now`), as Harmony's system message does.
        let endpoint_seed = match request {
            ParsedRequest::Completion(_) => 1,
            ParsedRequest::Chat(_) => 2,
        };
        // The local day, as templates print it.
        let day = xxh3_64(kvroute_proto::openai::chat_template::today().as_bytes());
        let what = (endpoint_seed, day, body);
        let key = (u128::from(self.keys.0.hash_one(what)) << 64) | u128::from(self.keys.1.hash_one(what));
        if let Some(hit) = self.cache.lock().unwrap_or_else(|e| e.into_inner()).map.get(&key).cloned() {
            return Ok(PromptInfo { namespace, tokens: hit.as_ref().clone(), unhashed_tokens: None });
        }
        // However busy: a tokenization is not a generation. A LoRA adapter's is asked of the
        // replicas that have it, as its request goes to them (the others answer 404).
        let verdicts = verdicts_for(fleet.iter().map(|m| &*m.upstream), u32::MAX, adapter);
        let mut askable: Vec<&str> = fleet
            .iter()
            .zip(verdicts)
            .filter_map(|(m, verdict)| verdict.is_none().then_some(m.replica.spec.http_url.as_str()))
            .collect();
        if !askable.is_empty() {
            let turn = (key % askable.len() as u128) as usize;
            askable.rotate_left(turn);
        }
        if askable.is_empty()
            && let Some(Adapter::Loaded(name) | Adapter::Listed(name)) = adapter
        {
            return Err(PromptError::Remote(format!("no replica up has the LoRA adapter {name}")));
        }
        let replica_urls = askable.as_slice();
        // Token-id prompts need no replica; everything else asks one.
        let tokens = match request {
            ParsedRequest::Completion(r) => {
                let mut out = Vec::new();
                for input in r.prompt.inputs() {
                    out.push(match input {
                        kvroute_proto::openai::PromptInput::Tokens(ids) => {
                            self.local.truncated(ids.to_vec(), r.truncation, false)
                        }
                        kvroute_proto::openai::PromptInput::Text(text) => {
                            let mut req = serde_json::json!({
                                "prompt": text,
                                "add_special_tokens": r.add_special_tokens,
                            });
                            if !r.model.is_empty() {
                                req["model"] = r.model.as_ref().into();
                            }
                            let ids = self.ask(replica_urls, req).await?;
                            self.truncated(replica_urls, ids, r.truncation, r.add_special_tokens).await?
                        }
                    });
                }
                out
            }
            ParsedRequest::Chat(chat) if let Some(ids) = self.local.harmony_ids(chat)? => vec![ids],
            ParsedRequest::Chat(chat) => {
                // Send the chat body as the replica would receive it: /tokenize accepts the
                // same `messages` and every option of how they are rendered (vLLM's
                // `TokenizeChatRequest`).
                let mut value: serde_json::Value =
                    serde_json::from_slice(body).map_err(RequestError::Json)?;
                if let Some(obj) = value.as_object_mut() {
                    chat_endpoint_options(obj, self.local.chat_options());
                    obj.retain(|k, _| {
                        matches!(
                            k.as_str(),
                            "model"
                                | "messages"
                                | "add_generation_prompt"
                                | "continue_final_message"
                                | "chat_template"
                                | "chat_template_kwargs"
                                | "tools"
                                | "mm_processor_kwargs"
                                | "add_special_tokens"
                        )
                    });
                }
                let ids = self.ask(replica_urls, value).await?;
                vec![self.truncated(replica_urls, ids, chat.truncation, chat.add_special_tokens).await?]
            }
        };
        self.cache.lock().unwrap_or_else(|e| e.into_inner()).keep(key, &tokens);
        Ok(PromptInfo { namespace, tokens, unhashed_tokens: None })
    }

    /// `ids` the replicas encoded, as they keep them ([`Tokenization::truncated`]); the
    /// special tokens the model's tokenizer adds are asked of them, once.
    async fn truncated(
        &self,
        replicas: &[&str],
        ids: Vec<u32>,
        truncation: Option<Truncation>,
        special: bool,
    ) -> Result<Vec<u32>, PromptError> {
        let Some(truncation) = truncation else { return Ok(ids) };
        let context = self.local.context_len();
        if truncation.kept(context).is_none_or(|k| ids.len() <= k) {
            return Ok(ids);
        }
        let specials: &[u32] = match special && truncation.side.is_none() {
            true => {
                self.specials
                    .get_or_try_init(|| {
                        self.ask(replicas, serde_json::json!({"prompt": "", "add_special_tokens": true}))
                    })
                    .await?
            }
            false => &[],
        };
        Ok(truncation.apply(ids, specials, context))
    }

    /// Asks `replicas` in turn until one answers (or refuses the prompt: the client's error).
    /// A 404 (the model, an adapter say, is not on that replica) asks the next too; from every
    /// replica asked, it is the client's answer.
    async fn ask(&self, replicas: &[&str], body: serde_json::Value) -> Result<Vec<u32>, PromptError> {
        let body = Bytes::from(body.to_string());
        let (mut failures, mut not_served) = (Vec::new(), Vec::new());
        for base in replicas.iter().take(TOKENIZE_ATTEMPTS) {
            match self.ask_one(base, body.clone()).await {
                Err(PromptError::Remote(why)) => {
                    tracing::warn!(replica = %base, error = %why, "remote tokenization failed; asking the next replica");
                    failures.push(why);
                }
                Err(PromptError::NotServed(said)) => {
                    failures.push(format!("{base}/tokenize answered 404: {said}"));
                    not_served.push(said);
                }
                answer => return answer,
            }
        }
        match not_served.len() == failures.len() {
            true if let Some(said) = not_served.into_iter().next() => Err(PromptError::NotServed(said)),
            _ if failures.is_empty() => Err(PromptError::Remote("no healthy replica to ask".into())),
            _ => Err(PromptError::Remote(failures.join("; "))),
        }
    }

    async fn ask_one(&self, base: &str, body: Bytes) -> Result<Vec<u32>, PromptError> {
        let body_len = body.len();
        let request = http::Request::post(format!("{base}/tokenize"))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(full(body))
            .map_err(|e| PromptError::Remote(e.to_string()))?;
        // One deadline for the whole answer, head and body.
        let deadline = tokio::time::Instant::now() + self.timeout;
        let response = tokio::time::timeout_at(deadline, self.client.request(request))
            .await
            .map_err(|_| PromptError::Remote(format!("{base}/tokenize timed out")))?
            .map_err(|e| PromptError::Remote(format!("{base}/tokenize: {e}")))?;
        let status = response.status();
        let limit = tokenize_answer_limit(body_len);
        let body = super::body::read_at_most(response.into_body(), limit);
        let bytes = tokio::time::timeout_at(deadline, body)
            .await
            .map_err(|_| PromptError::Remote(format!("{base}/tokenize timed out")))?
            .map_err(|e| PromptError::Remote(format!("{base}/tokenize: {e}")))?;
        if status == http::StatusCode::BAD_REQUEST || status == http::StatusCode::UNPROCESSABLE_ENTITY {
            return Err(PromptError::Refused(String::from_utf8_lossy(&bytes).into_owned()));
        }
        // vLLM's answer for a model it does not serve, an OpenAI-shaped error (a server
        // without the route answers `{"detail": "Not Found"}`: a failure of the replica's).
        if status == http::StatusCode::NOT_FOUND && openai_error(&bytes) {
            return Err(PromptError::NotServed(String::from_utf8_lossy(&bytes).into_owned()));
        }
        if !status.is_success() {
            return Err(PromptError::Remote(format!(
                "{base}/tokenize answered {status}: {}",
                String::from_utf8_lossy(&bytes)
            )));
        }
        #[derive(serde::Deserialize)]
        struct Tokenized {
            tokens: Vec<u32>,
        }
        let parsed: Tokenized = serde_json::from_slice(&bytes)
            .map_err(|e| PromptError::Remote(format!("{base}/tokenize: unexpected answer: {e}")))?;
        Ok(parsed.tokens)
    }
}

/// Whether `body` is an error answer: OpenAI's shape (`{"error": {...}}`), or the flat one of
/// older vLLM and of SGLang (`{"object": "error", "message": ...}`).
fn openai_error(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Answer<'a> {
        #[serde(borrow)]
        error: Option<&'a serde_json::value::RawValue>,
        #[serde(borrow)]
        object: Option<&'a str>,
        #[serde(borrow)]
        message: Option<&'a serde_json::value::RawValue>,
    }
    serde_json::from_slice::<Answer<'_>>(body).is_ok_and(|a| {
        a.error.is_some_and(|e| e.get().starts_with('{'))
            || (a.object == Some("error") && a.message.is_some())
    })
}

/// The most bytes of a `/tokenize` answer read for a request of `asked` bytes: a token is at
/// least a byte of the text asked (byte fallback included), and at most 11 bytes of JSON
/// (`4294967295,`); a chat template's own text, special tokens and the answer's other fields
/// fit in the 1 MiB beside. So a replica (or whatever answers at its address) cannot make a
/// short prompt cost the router megabytes; the whole is capped at 64 MiB, about 6 M tokens.
fn tokenize_answer_limit(asked: usize) -> usize {
    asked.saturating_mul(11).saturating_add(1 << 20).min(4 * super::body::REPLICA_ANSWER_BYTES)
}

#[cfg(test)]
mod tests {
    use kvroute_proto::openai::TokenizationConfig;

    use super::*;

    /// The remote tokenizer's cache holds at most its bytes' worth of tokens, the oldest
    /// answers giving way, and does not keep one answer over a sixteenth of them.
    #[test]
    fn the_remote_cache_is_bounded_by_its_bytes() {
        let mut cache = Cache::default();
        let answer = vec![vec![7u32; REMOTE_CACHE_BYTES / 64 / 4]];
        for key in 0..100 {
            cache.keep(key, &answer);
        }
        assert!(cache.bytes <= REMOTE_CACHE_BYTES, "{} bytes", cache.bytes);
        assert_eq!(cache.map.len(), 64);
        assert!(cache.map.contains_key(&99) && !cache.map.contains_key(&35), "the oldest gave way");
        cache.keep(1000, &[vec![7u32; REMOTE_CACHE_BYTES / 4]]);
        assert!(!cache.map.contains_key(&1000), "too large to keep");
        assert_eq!(cache.map.len(), 64);
    }

    /// Work on the blocking pool keeps its turn until it is done, though the request that
    /// started it left: clients that send long prompts and leave at once cannot pile up more
    /// of them than there are turns.
    #[tokio::test]
    async fn blocking_work_keeps_its_turn_after_its_request_left() {
        static TURNS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
        let (finish, finished) = std::sync::mpsc::channel::<()>();
        {
            let work = off_the_thread(&TURNS, move || finished.recv().ok());
            tokio::pin!(work);
            assert!(futures::poll!(work.as_mut()).is_pending(), "working");
        }
        assert_eq!(TURNS.available_permits(), 0, "the work holds its turn");
        finish.send(()).unwrap();
        let freed = tokio::time::timeout(std::time::Duration::from_secs(10), TURNS.acquire()).await;
        assert!(freed.is_ok(), "the turn is given back when the work is done");
    }

    /// A long text is tokenized off this thread, and to the same ids as in place, for
    /// completions (a batch, or one text) and chats.
    #[tokio::test]
    async fn long_texts_tokenize_off_the_thread_to_the_same_ids() {
        let config = TokenizationConfig { base_model: "m".into(), ..TokenizationConfig::default() };
        let local = Arc::new(Tokenization::new(&config).unwrap());
        let prompts = Prompts::Local(local.clone());
        let text = (0..BLOCKING_TEXT_BYTES / 2).map(|i| format!("w{}", i % 97)).collect::<Vec<_>>().join(" ");
        let bodies = [
            (Endpoint::Completions, serde_json::json!({"model": "m", "prompt": [text.clone(), "x"]})),
            (Endpoint::Completions, serde_json::json!({"model": "m", "prompt": text})),
            (
                Endpoint::ChatCompletions,
                serde_json::json!({"model": "m", "messages": [{"role": "user", "content": text}]}),
            ),
        ];
        for (endpoint, body) in bodies {
            let body = body.to_string().into_bytes();
            assert!(body.len() >= BLOCKING_TEXT_BYTES);
            let mut request = ParsedRequest::parse(endpoint, &body).unwrap();
            let info = prompts.tokens(&mut request, &body, (&[], None)).await.unwrap();
            let mut again = ParsedRequest::parse(endpoint, &body).unwrap();
            assert_eq!(info.tokens, local.take_prompt_tokens(&mut again).unwrap(), "{endpoint:?}");
            assert_eq!(info.namespace, local.namespace(&again));
        }
    }
}
