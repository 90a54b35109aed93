//! `POST /v1/completions`, `POST /v1/chat/completions` and `POST /v1/messages`: from a
//! request body to engine jobs to an OpenAI (or, for `/v1/messages`, Anthropic) response.
//!
//! 1. Parse with [`ParsedRequest`] (the same parser and [`Tokenization`] the router uses; a
//!    Messages body as the chat request vLLM makes of it),
//!    plus the fields only the replica cares about: the sampling parameters, checked as vLLM
//!    checks them ([`sampling`]), and `stream_options.include_usage`.
//! 2. Check the model (404 unless it is the base model or a LoRA adapter), tokenize, hash
//!    the prompt blocks in the request's cache namespace and check every prompt against
//!    `max_model_len` (400, worded as vLLM words it). Without `max_tokens` a request gets
//!    `default_max_tokens`: a completion as if it had asked for them (vLLM's protocol
//!    default), a chat cut to what the context leaves.
//! 3. Submit one engine job per choice (`n` a prompt; a batch completion prompt is several),
//!    as vLLM runs one engine request per choice, and wait for
//!    each to be admitted, so a request the engine refuses still gets a proper status
//!    (503 overloaded or shutting down, 500 engine failure) instead of a broken stream.
//! 4. Without `stream`, collect the text and answer one JSON object; with `stream`, answer
//!    an SSE body that forwards each token as the engine emits it ([`sse`]).
//!
//! Sampling parameters are ignored once those the agent checks (`temperature`, `top_p`,
//! `stop`, ... as vLLM does) pass; `seed`, `logprobs`, `top_logprobs` and `echo` are not
//! checked, and choices carry no logprobs and no echoed prompt. The simulated text depends
//! only on the prompt and the agent's `--seed`.
//! The simulated engine always generates exactly `max_tokens` tokens, so `finish_reason` is
//! always `"length"`. `usage.prompt_tokens_details.cached_tokens` is the engine's realized
//! prefix-cache hit of one prompt, as vLLM reports it for a request of several prompts or
//! choices ([`Tally`]); a prompt's later choices find its blocks cached by the first.
//!
//! [`Tokenization`]: kvroute_proto::openai::Tokenization
//! [`sse`]: super::sse
//! [`sampling`]: super::sampling

use futures::{StreamExt, TryStreamExt};
use hyper::header::{self, HeaderValue};
use hyper::{Response, StatusCode};
use kvroute_proto::openai::request::sglang as sglang_request;
use kvroute_proto::openai::request::{lax_boolean_value, parse_object};
use kvroute_proto::openai::{Endpoint, ParsedRequest};
use serde::Serialize;
use serde_json::value::RawValue;
use tokio::sync::mpsc;

use super::error::ApiError;
use super::sampling::{self, Sampling};
use super::{AppState, Body, chat, completions, json_response, messages, responses, sglang, sse, unix_now};
use crate::bootstrap::{self, Bootstrap, Mode, Transfer};
use crate::config::{Config, SchedulingPolicy};
use crate::engine::{Job, Output, SubmitError, Usage};
use crate::kv_transfer::{self, Asked};

/// `finish_reason` of every choice: the simulated engine stops only at `max_tokens`.
pub(super) const FINISH_REASON: &str = "length";

/// What the response shapes share: `id`, `created`, `model`.
#[derive(Debug, Clone)]
pub(super) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

/// OpenAI's `usage` object, with the realized prefix-cache hit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(super) struct UsageJson {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub(super) struct PromptTokensDetails {
    pub cached_tokens: u64,
}

/// A request's usage as vLLM 0.33 counts it, with `n` choices a prompt (one engine request
/// each) and maybe several prompts: every prompt's tokens once, every choice's completion
/// tokens, and the cached tokens of one choice of the whole request: in a stream, the choice
/// whose output came first; else the last one in order (the last prompt's last choice,
/// which here is also the last to finish).
pub(super) struct Tally {
    n: usize,
    stream: bool,
    completion_tokens: u64,
    /// Each prompt's tokens, once known.
    prompts: Vec<Option<u32>>,
    cached_tokens: Option<u32>,
}

impl Tally {
    /// For `choices` choices, `n` a prompt (choice `i` is of prompt `i / n`).
    pub fn new(choices: usize, n: usize, stream: bool) -> Self {
        let n = n.max(1);
        Self {
            n,
            stream,
            completion_tokens: 0,
            prompts: vec![None; choices.div_ceil(n)],
            cached_tokens: None,
        }
    }

    /// Choice `choice` produced output, with `cached_tokens` of its `prompt_tokens` cached.
    pub fn output(&mut self, choice: usize, prompt_tokens: u32, cached_tokens: u32) {
        if let Some(slot) = self.prompts.get_mut(choice / self.n) {
            *slot = Some(prompt_tokens);
        }
        if self.cached_tokens.is_none() || !self.stream {
            self.cached_tokens = Some(cached_tokens);
        }
    }

    /// Choice `choice` finished with `usage`.
    pub fn done(&mut self, choice: usize, usage: &Usage) {
        self.completion_tokens += u64::from(usage.completion_tokens);
        self.output(choice, usage.prompt_tokens, usage.cached_tokens);
    }

    pub fn usage(&self) -> UsageJson {
        let prompt_tokens = self.prompts.iter().flatten().map(|&p| u64::from(p)).sum();
        UsageJson {
            prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: prompt_tokens + self.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: self.cached_tokens.map_or(0, u64::from),
            },
        }
    }
}

/// One prompt of the request, admitted by the engine: its output channel (past `Started`)
/// and how many tokens it will generate.
pub(super) struct Admitted {
    pub rx: mpsc::Receiver<Output>,
    pub max_tokens: u32,
    pub prompt_tokens: u32,
    /// What the prefix cache served of the prompt, known at admission.
    pub cached_tokens: u32,
}

/// What the server reads of a request itself.
#[derive(Clone, Debug, PartialEq)]
struct ServerFields {
    sampling: Sampling,
    /// What a stream's chunks say of the usage.
    usage: StreamUsage,
    /// What `kv_transfer_params` ask ([`crate::kv_transfer`]).
    transfer: Asked,
    /// Its SGLang hand-over, in a disaggregated agent ([`crate::bootstrap`]).
    bootstrap: Option<Bootstrap>,
    /// A `/generate` request's `rid`, its answer's id (SGLang's).
    rid: Option<String>,
    /// A `/generate` request's `max_new_tokens`: its one `sampling_params`', or each prompt's.
    max_new_tokens: Vec<Option<u64>>,
}

/// `stream_options` as vLLM reads it: `include_usage`, and `continuous_usage_stats` (with
/// `include_usage`, every chunk carries the usage so far of its choice).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct StreamUsage {
    pub include: bool,
    pub continuous: bool,
}

/// Serves one completion or chat completion request, on data-parallel rank `rank` if the
/// client named one.
pub(super) async fn generate(
    state: &AppState,
    endpoint: Endpoint,
    body: &[u8],
    request_id: &str,
    rank: Option<u32>,
) -> Result<Response<Body>, ApiError> {
    let started = std::time::Instant::now();
    let (chat, mut keep, previous, background) = match endpoint {
        Endpoint::Responses => {
            let prepared = responses::prepare(state.responses(), body, state.tokenization().is_harmony())?;
            (Some(prepared.chat), prepared.keep, prepared.previous, prepared.background)
        }
        _ => (None, None, None, false),
    };
    let (read_as, readable) = match &chat {
        Some(chat) => (Endpoint::ChatCompletions, std::borrow::Cow::Borrowed(&chat[..])),
        None => state.tokenization().readable(endpoint, body)?,
    };
    let mut request = ParsedRequest::parse(read_as, &readable)?;
    // A Messages or Responses stream always carries its usage; the fields are OpenAI's.
    if !state.serves(request.model()) {
        return Err(ApiError::model_not_found(request.model()));
    }
    if background && request.stream() {
        return Err(ApiError::bad_request(
            "a background stream is not simulated (vLLM's goes on when its client leaves)",
        ));
    }
    let ServerFields { sampling, usage, transfer, bootstrap, rid, max_new_tokens } = match endpoint {
        Endpoint::Messages | Endpoint::Responses => ServerFields {
            sampling: converted_sampling(body, endpoint)?,
            usage: StreamUsage { include: true, continuous: false },
            transfer: Asked::Nothing,
            bootstrap: None,
            rid: None,
            max_new_tokens: Vec::new(),
        },
        Endpoint::Generate => native_extras(body, state.config())?,
        _ => parse_extras(body, request.stream(), state.config())?,
    };
    // SGLang's: each prompt's own `max_new_tokens`, checked against the context if given, else
    // 128 of what the context leaves (the prompts are checked first as unbounded ones).
    let native = endpoint == Endpoint::Generate;
    if let (true, ParsedRequest::Completion(completion)) = (native, &mut request) {
        completion.max_tokens = None;
    }
    let mut jobs = jobs(state, &request, &sampling, native || null_max_tokens(&request, &readable))?;
    if request.reads_no_cache(endpoint, body) {
        jobs.iter_mut().for_each(|job| job.reads_cache = false);
    }
    if native {
        let max_model_len = state.config().max_model_len;
        for (i, job) in jobs.iter_mut().enumerate() {
            let own = max_new_tokens.get(i).or(max_new_tokens.first()).copied().flatten();
            let (len, default) = (job.prompt.len(), sglang_request::DEFAULT_MAX_NEW_TOKENS);
            let room = (max_model_len as usize).saturating_sub(len) as u64;
            let own = match own {
                Some(own) if own > room => {
                    return Err(ApiError::context_length(max_model_len, len, own, "prompt"));
                }
                Some(own) => own,
                None => default.min(room),
            };
            job.max_tokens = u32::try_from(own).unwrap_or(u32::MAX);
        }
    }
    // A batch (a list of prompts, of one too) or several choices is answered with a list, in
    // SGLang's API.
    let listed = sampling.choices() > 1 || request.is_batch();
    // One prompt of one choice is pulled, or answered for ([`crate::kv_transfer`]).
    let transfer = if jobs.len() == 1 && sampling.choices() == 1 { transfer } else { Asked::Nothing };
    let block_size = state.engine().config().cache.block_size;
    if let (Asked::RemotePrefill { blocks }, [job]) = (&transfer, &mut jobs[..]) {
        job.remote_tokens = kv_transfer::pulled_tokens(*blocks, block_size, job.prompt.len());
    }
    let priority = request.priority();
    if priority != 0 && state.config().scheduling_policy == SchedulingPolicy::Fcfs {
        return Err(ApiError::bad_request(format!(
            "Got priority {priority} but Priority scheduling is not enabled."
        )));
    }
    for job in &mut jobs {
        job.priority = priority;
    }
    let n = sampling.choices();
    // Every choice of every prompt is an engine request, all queued at once: a request that
    // needs more than the queue holds could never be admitted (a 503 would send it on to the
    // next replica, to the same end).
    let max_waiting = state.engine().config().max_waiting;
    let requests = jobs.len().saturating_mul(n as usize);
    if requests > max_waiting {
        return Err(ApiError::bad_request(format!(
            "{} prompts times n ({n}) is {requests} requests, more than this replica queues ({max_waiting})",
            jobs.len()
        )));
    }
    // A room for each prompt ([`crate::bootstrap`]), once the request is known to be taken.
    let rooms = match &bootstrap {
        Some(bootstrap) => bootstrap.rooms(jobs.len()).map_err(ApiError::bad_request)?,
        None => Vec::new(),
    };
    if !rooms.is_empty() {
        if sampling.choices() != 1 {
            return Err(ApiError::bad_request(
                "a bootstrap room for several choices is not simulated (SGLang gives every choice of a prompt its first room)",
            ));
        }
        match state.config().disaggregation_mode {
            Mode::Prefill if request.stream() => {
                return Err(ApiError::bad_request(
                    "a prefill replica's stream is not simulated: ask it for a whole answer",
                ));
            }
            // The prompt and its first token (SGLang's prefill replica computes no more).
            Mode::Prefill => jobs.iter_mut().for_each(|job| job.max_tokens = 1),
            Mode::Decode => {
                let own_port = state.config().disaggregation_bootstrap_port;
                // At most `PULLS` at a time (a connection each), in the rooms' order.
                let rooms_of = state.rooms();
                let pulls =
                    rooms.iter().cloned().map(|room| async move { rooms_of.pull(&room, own_port).await });
                // (Cut short by a stop, it is refused as the stop refuses new requests.)
                let failed = |why| match state.shutting_down() {
                    true => ApiError::shutting_down(),
                    false => ApiError::engine_failed(why),
                };
                let pulled: Vec<Transfer> =
                    (futures::stream::iter(pulls).buffered(PULLS).try_collect().await).map_err(failed)?;
                for (job, transfer) in jobs.iter_mut().zip(pulled) {
                    job.remote_tokens = job.prompt.len().saturating_sub(1);
                    job.reports_cached = Some(transfer.cached_tokens);
                }
            }
            Mode::Null => {}
        }
    }
    // Each prompt's `n` choices in turn, as vLLM numbers them (`prompt * n + choice`).
    let jobs: Vec<Job> = jobs
        .into_iter()
        .flat_map(|job| {
            let more: Vec<Job> = (1..n).map(|choice| job.sample(choice)).collect();
            std::iter::once(job).chain(more)
        })
        .collect();
    let meta = Meta {
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{request_id}"),
            Endpoint::ChatCompletions => format!("chatcmpl-{request_id}"),
            Endpoint::Messages => format!("msg_{request_id}"),
            // Not the request id, which a client may send again: a stored response's id is
            // its own (vLLM's: 16 random hex digits).
            Endpoint::Responses => format!("resp_{:016x}", rand::random::<u64>()),
            Endpoint::Generate => rid.unwrap_or_else(|| request_id.to_owned()),
        },
        created: unix_now(),
        // A request that names no model is answered as the base model's, as vLLM does.
        model: match request.model() {
            "" => state.config().model.clone(),
            named => named.to_owned(),
        },
    };
    let stream = request.stream();
    drop(request);

    let mut admitted = Vec::with_capacity(jobs.len());
    let mut dp_rank = 0;
    for job in jobs {
        let (max_tokens, prompt_tokens) = (job.max_tokens, job.prompt.len() as u32);
        // Each choice is an engine request of its own, placed on its own (as vLLM places them).
        let engine = state.ranks().pick(rank).unwrap_or_else(|| state.engine());
        dp_rank = engine.config().dp_rank;
        let rx = engine.submit(job).map_err(|e| match e {
            SubmitError::Overloaded(_) => ApiError::overloaded(e.to_string()),
            SubmitError::ShuttingDown => ApiError::shutting_down(),
        })?;
        admitted.push(Admitted { rx, max_tokens, prompt_tokens, cached_tokens: 0 });
    }
    // Answered now, `queued` (vLLM's answers before the engine schedules it), and generated
    // after, a failure stored as such (a Responses request has one prompt).
    if background
        && let Some(keep) = keep.take()
        && let Some(one) = admitted.pop()
    {
        return Ok(json_response(StatusCode::OK, keep.in_background(meta, one)));
    }
    // Wait for every prompt's admission: a refusal still gets a status code.
    for a in &mut admitted {
        match a.rx.recv().await {
            Some(Output::Started { cached_tokens }) => a.cached_tokens = cached_tokens,
            Some(Output::Failed(why)) => return Err(failure(state, why)),
            Some(other) => {
                return Err(ApiError::engine_failed(format!(
                    "engine sent {other:?} before admitting the request"
                )));
            }
            None => return Err(failure(state, "the engine stopped before admitting the request".into())),
        }
    }

    let api = Api::from(endpoint);
    if stream {
        let streaming = (api == Api::Responses).then(|| responses::Streaming {
            keep,
            previous,
            text: String::new(),
            sequence: 0,
        });
        let native = (api == Api::Native).then(|| sglang::Streaming::new(admitted.len(), listed, started));
        let tally = Tally::new(admitted.len(), n as usize, true);
        let mut response = Response::new(sse::body(api, meta, admitted, (usage, tally), (streaming, native)));
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(response);
    }
    // What a prefill replica hands over for each prompt (one choice each).
    let hands_over = state.config().disaggregation_mode == Mode::Prefill && !rooms.is_empty();
    let handed: Vec<Transfer> = (admitted.iter().filter(|_| hands_over))
        .map(|a| Transfer { prompt_tokens: a.prompt_tokens as usize, cached_tokens: a.cached_tokens })
        .collect();
    let mut texts = Vec::with_capacity(admitted.len());
    // SGLang's answer is each choice's, with its ids.
    let mut native = Vec::with_capacity(if api == Api::Native { admitted.len() } else { 0 });
    let mut tally = Tally::new(admitted.len(), n as usize, false);
    for (choice, mut a) in admitted.into_iter().enumerate() {
        let mut text = String::new();
        let mut output = sglang::Output::default();
        loop {
            match a.rx.recv().await {
                Some(Output::Token(t)) if api == Api::Native => output.push(t),
                Some(Output::Token(t)) => text.push_str(t),
                Some(Output::Done(u)) => {
                    tally.done(choice, &u);
                    if api == Api::Native {
                        native.push((std::mem::take(&mut output), u));
                    }
                    break;
                }
                Some(Output::Started { .. }) => {}
                Some(Output::Failed(why)) => return Err(failure(state, why)),
                None => return Err(failure(state, "the engine stopped before finishing the request".into())),
            }
        }
        texts.push(text);
    }
    let usage = tally.usage();
    if hands_over {
        // Answered once the decode replica took every prompt's KV.
        let handing =
            rooms.iter().zip(handed).map(|(room, transfer)| state.rooms().hand_over(room.room, transfer));
        futures::future::try_join_all(handing).await.map_err(ApiError::engine_failed)?;
    }
    let produced = match (&transfer, &state.config().kv_transfer_config) {
        // (Asked of one prompt of one choice only: see above.)
        (Asked::RemoteDecode, Some(config)) => {
            let prompt = (usage.prompt_tokens as usize, block_size);
            Some(kv_transfer::produced(config, &state.config().name, request_id, prompt, dp_rank))
        }
        _ => None,
    };
    let body = match api {
        Api::Completions => completions::response(&meta, &texts, &usage, produced.as_ref()),
        Api::Chat => chat::response(&meta, &texts, &usage, produced.as_ref()),
        Api::Messages => messages::response(&meta, &texts, &usage),
        Api::Responses => {
            let text = texts.first().map_or("", String::as_str);
            if let Some(keep) = keep {
                keep.store(&meta, text, &usage);
            }
            responses::response(&meta, text, &usage, previous.as_deref())
        }
        Api::Native => sglang::response(sglang::Naming { id: &meta.id, several: listed }, &native, started),
    };
    Ok(json_response(StatusCode::OK, body))
}

/// Rooms a decode replica pulls from at once.
const PULLS: usize = 64;

/// Which response shapes to write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Api {
    Completions,
    Chat,
    /// Anthropic's Messages API.
    Messages,
    /// OpenAI's Responses API.
    Responses,
    /// SGLang's native `/generate`.
    Native,
}

impl From<Endpoint> for Api {
    fn from(endpoint: Endpoint) -> Self {
        match endpoint {
            Endpoint::Completions => Api::Completions,
            Endpoint::ChatCompletions => Api::Chat,
            Endpoint::Messages => Api::Messages,
            Endpoint::Responses => Api::Responses,
            Endpoint::Generate => Api::Native,
        }
    }
}

/// An engine failure: 503 while the server shuts down (retry elsewhere), else 500.
pub(super) fn failure(state: &AppState, why: String) -> ApiError {
    if state.shutting_down() { ApiError::shutting_down() } else { ApiError::engine_failed(why) }
}

/// Whether a completion says `"max_tokens": null` (the last of its `max_tokens` keys, as
/// Python reads JSON), which drops the default of 16 in vLLM (the default is the field's).
/// The shared parser reads null as absent; the body is read again only for a completion
/// without a limit.
fn null_max_tokens(request: &ParsedRequest<'_>, body: &[u8]) -> bool {
    matches!(request, ParsedRequest::Completion(_))
        && request.max_tokens().is_none()
        && serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body)
            .is_ok_and(|fields| fields.get("max_tokens") == Some(&serde_json::Value::Null))
}

/// Validates the sampling parameters ([`sampling`]) and `stream_options`.
fn parse_extras(body: &[u8], stream: bool, config: &Config) -> Result<ServerFields, ApiError> {
    // The fields of a generation request that [`ParsedRequest`] leaves to the server, a
    // repeated key's last value counting, as in vLLM.
    let sampling = Sampling::parse(parse_object(body, &sampling::FIELDS)?)?;
    let [stream_options, params, host, port, room] = parse_object(
        body,
        &["stream_options", "kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room"],
    )?;
    let transfer = kv_transfer::asked(params, config.kv_transfer_config.as_ref())
        .map_err(|e| ApiError::invalid_field("kv_transfer_params", e))?;
    let bootstrap =
        bootstrap::asked(config.disaggregation_mode, [host, port, room]).map_err(ApiError::bad_request)?;
    Ok(ServerFields {
        sampling,
        usage: stream_usage(stream_options, stream)?,
        transfer,
        bootstrap,
        rid: None,
        max_new_tokens: Vec::new(),
    })
}

/// The fields of a `/generate` request (SGLang's) that its completion leaves to the server:
/// its `sampling_params` (an object, or a list of them, one a prompt, each checked as the
/// agent checks a completion's), its `rid` (a string) and its bootstrap room.
fn native_extras(body: &[u8], config: &Config) -> Result<ServerFields, ApiError> {
    let [params, rid, host, port, room] = parse_object(
        body,
        &["sampling_params", "rid", "bootstrap_host", "bootstrap_port", "bootstrap_room"],
    )?;
    let params: Vec<Option<&RawValue>> = match params.filter(|p| p.get().starts_with('[')) {
        Some(list) => serde_json::from_str(list.get())
            .map_err(|_| ApiError::invalid_field("sampling_params", "a list of objects"))?,
        None => vec![params],
    };
    let mut sampling = Vec::with_capacity(params.len());
    let mut max_new_tokens = Vec::with_capacity(params.len());
    for params in params.into_iter().map(|p| p.filter(|p| p.get() != "null")) {
        let fields = match params {
            Some(p) => parse_object(p.get().as_bytes(), &sampling::NATIVE_FIELDS)?,
            None => Default::default(),
        };
        sampling.push(Sampling::parse(fields)?.as_sglang());
        max_new_tokens.push(sglang_request::max_new_tokens(params)?);
    }
    // The first prompt's are checked with its prompt ([`jobs`]); the others' ranges here.
    for later in sampling.iter().skip(1) {
        later.check(u64::MAX)?;
    }
    let bootstrap =
        bootstrap::asked(config.disaggregation_mode, [host, port, room]).map_err(ApiError::bad_request)?;
    let rid = rid.and_then(|rid| serde_json::from_str::<String>(rid.get()).ok());
    Ok(ServerFields {
        sampling: sampling.first().copied().unwrap_or_default(),
        usage: StreamUsage::default(),
        transfer: Asked::Nothing,
        bootstrap,
        rid,
        max_new_tokens,
    })
}

/// The sampling fields of a Messages or Responses request, which vLLM carries over to the
/// chat request it makes of it (`temperature`, `top_p`, `top_k`, and a Messages request's
/// `stop_sequences` as `stop`) and so checks as a chat request's.
fn converted_sampling(body: &[u8], endpoint: Endpoint) -> Result<Sampling, ApiError> {
    let stop = if endpoint == Endpoint::Messages { "stop_sequences" } else { "stop" };
    let [temperature, top_p, top_k, stop] = parse_object(body, &["temperature", "top_p", "top_k", stop])?;
    let stop = stop.filter(|_| endpoint == Endpoint::Messages);
    Sampling::parse([None, temperature, None, None, None, top_p, top_k, None, None, stop])
}

/// `stream_options` as vLLM reads it: an object asks for usage unless its `include_usage` is
/// false or null, and for it on every chunk if `continuous_usage_stats` is also true; only an
/// empty one may come without `stream`.
fn stream_usage(options: Option<&RawValue>, stream: bool) -> Result<StreamUsage, ApiError> {
    let Some(options) = options.filter(|o| o.get() != "null") else { return Ok(StreamUsage::default()) };
    let bad = || ApiError::invalid_field("stream_options", "'stream_options' must be an object");
    // A map: a repeated key's last value counts, as in Python's `json.loads`.
    let options: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(options.get()).map_err(|_| bad())?;
    if !stream {
        if options.is_empty() {
            return Ok(StreamUsage::default());
        }
        return Err(ApiError::invalid_field(
            "stream_options",
            "stream_options can only be set when stream is true",
        ));
    }
    let flag = |key: &str, absent: bool| match options.get(key) {
        None => Ok(absent),
        Some(serde_json::Value::Null) => Ok(false),
        // Read as pydantic's lax mode reads a boolean (`1`, `"yes"`).
        Some(value) => lax_boolean_value(value).ok_or_else(|| {
            ApiError::invalid_field("stream_options", format!("'stream_options.{key}' must be a boolean"))
        }),
    };
    // Both are checked, as pydantic checks every field.
    let (include, continuous) = (flag("include_usage", true)?, flag("continuous_usage_stats", false)?);
    Ok(StreamUsage { include, continuous: include && continuous })
}

/// One engine job per prompt: tokens, block hashes in the request's namespace, and a
/// `max_tokens` that fits the context.
///
/// Every prompt is checked against the context first, then the sampling parameters against
/// each prompt's `max_tokens`, in vLLM's order.
fn jobs(
    state: &AppState,
    request: &ParsedRequest<'_>,
    sampling: &Sampling,
    null_max_tokens: bool,
) -> Result<Vec<Job>, ApiError> {
    let tokenization = state.tokenization();
    let config = state.config();
    let prompts = tokenization.prompt_tokens(request)?;
    let namespace = tokenization.namespace(request);
    let block_size = state.engine().config().cache.block_size;
    let max_prompt_tokens = state.engine().max_prompt_tokens();
    let param = match request {
        ParsedRequest::Completion(_) => "prompt",
        ParsedRequest::Chat(_) => "messages",
    };
    let max_model_len = u64::from(config.max_model_len);
    // A completion without `max_tokens` asks vLLM's protocol default (16; here
    // `--default-max-tokens`), checked against the context as one given is; a chat's (or a
    // completion's explicit null) is cut to what the context leaves.
    let asked = match request {
        ParsedRequest::Completion(_) if !null_max_tokens => {
            request.max_tokens().or(Some(u64::from(config.default_max_tokens)))
        }
        _ => request.max_tokens(),
    };
    // Each prompt, its room in the context, and the job's `max_tokens`.
    let mut checked = Vec::with_capacity(prompts.len());
    for prompt in prompts {
        if prompt.len() > max_prompt_tokens {
            return Err(ApiError::prompt_exceeds_cache(max_prompt_tokens, prompt.len(), param));
        }
        let len = prompt.len() as u64;
        let (limit, max_tokens) = match asked {
            // Saturating: `max_tokens` comes from the request and may be near u64::MAX.
            Some(m) if len.saturating_add(m) > max_model_len => {
                return Err(ApiError::context_length(config.max_model_len, prompt.len(), m, param));
            }
            Some(m) => (m, m),
            None if len >= max_model_len => {
                return Err(ApiError::context_length(config.max_model_len, prompt.len(), 1, param));
            }
            // vLLM gives what the context leaves; the agent generates its default of that
            // (at least `min_tokens` of it: vLLM stops no sooner).
            None => {
                let wanted = u64::from(config.default_max_tokens).max(sampling.min_tokens());
                (max_model_len - len, wanted.min(max_model_len - len).max(1))
            }
        };
        checked.push((prompt, limit, max_tokens));
    }
    for (_, limit, _) in &checked {
        sampling.check(*limit)?;
    }
    Ok(checked
        .into_iter()
        .map(|(prompt, _, max_tokens)| {
            let max_tokens = u32::try_from(max_tokens).unwrap_or(u32::MAX);
            Job::new(namespace.clone(), prompt, block_size, max_tokens)
        })
        .collect())
}

/// The `usage` key of a response or chunk: absent (streams without `include_usage`), `null`
/// (every chunk but the last when `include_usage` is set), or the counts.
#[derive(Clone, Copy, Debug)]
pub(super) enum UsageField<'a> {
    Absent,
    Null,
    Present(&'a UsageJson),
    /// A choice's counts so far (`continuous_usage_stats`): written without
    /// `prompt_tokens_details`, which vLLM leaves unset on these.
    SoFar(&'a UsageJson),
}

impl UsageField<'_> {
    fn is_absent(&self) -> bool {
        matches!(self, UsageField::Absent)
    }

    /// What stream chunks carry: `null` with `include_usage`, nothing without.
    pub fn for_chunks(include_usage: bool) -> Self {
        if include_usage { UsageField::Null } else { UsageField::Absent }
    }
}

impl Serialize for UsageField<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            UsageField::Absent | UsageField::Null => s.serialize_none(),
            UsageField::Present(u) => u.serialize(s),
            UsageField::SoFar(u) => {
                use serde::ser::SerializeStruct;
                let mut so_far = s.serialize_struct("UsageInfo", 3)?;
                so_far.serialize_field("prompt_tokens", &u.prompt_tokens)?;
                so_far.serialize_field("completion_tokens", &u.completion_tokens)?;
                so_far.serialize_field("total_tokens", &u.total_tokens)?;
                so_far.end()
            }
        }
    }
}

/// The keys every response object and chunk shares, around endpoint-specific `choices`.
#[derive(Serialize)]
pub(super) struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "UsageField::is_absent")]
    usage: UsageField<'a>,
    /// A prefill's answer to a remote decode ([`crate::kv_transfer`]): whole responses only.
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_transfer_params: Option<&'a serde_json::Value>,
}

impl<'a, C: Serialize> Envelope<'a, C> {
    pub fn new(meta: &'a Meta, object: &'static str, choices: C, usage: UsageField<'a>) -> Self {
        let kv_transfer_params = None;
        Envelope {
            id: &meta.id,
            object,
            created: meta.created,
            model: &meta.model,
            choices,
            usage,
            kv_transfer_params,
        }
    }

    /// With `params` as its `kv_transfer_params`, if any.
    pub fn transfer(self, params: Option<&'a serde_json::Value>) -> Self {
        Envelope { kv_transfer_params: params, ..self }
    }

    pub fn to_json(&self) -> Vec<u8> {
        // Strings, integers and options only: serializing into a Vec cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}
