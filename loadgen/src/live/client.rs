//! One completion request over HTTP, measured: the request body (the prompt as token ids or
//! as text, see [`PromptFormat`]; fixed `max_tokens`), the send, and for a stream the SSE
//! frames as they arrive.
//!
//! An SGLang `/generate` request ([`PromptFormat::Generate`]) is measured the same way, its
//! counts read from `meta_info`.
//!
//! Timing: TTFT is from sending the request to the first SSE event carrying a choice (the
//! first generated token); time per output token is `(e2e - ttft) / (completion_tokens - 1)`;
//! a non-streamed request has an end-to-end latency only. The realized hit comes from
//! `usage.prompt_tokens_details.cached_tokens` (the last chunk of a stream, which is why
//! streams set `stream_options.include_usage`); the router's prediction and choice from its
//! `x-kvroute-predicted-cached-tokens` and `x-kvroute-replica` headers. A request the router
//! prefilled on a prefill replica counts that replica's hit (`x-kvroute-prefill-cached-tokens`):
//! the decode replica's usage reports every token it pulled as cached.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tokio_rustls::rustls::ClientConfig;

use crate::workload::Request as WorkloadRequest;

/// The router's header naming the replica it chose.
pub const REPLICA_HEADER: &str = "x-kvroute-replica";
/// The router's header with the prompt tokens it predicted the chosen replica had cached.
pub const PREDICTED_HEADER: &str = "x-kvroute-predicted-cached-tokens";
/// The router's header with what the prefill replica reported cached, when the prompt was
/// prefilled on one (prefill/decode disaggregation).
pub const PREFILL_CACHED_HEADER: &str = "x-kvroute-prefill-cached-tokens";
/// The router's header naming the prefill replica, when the prompt was prefilled on one.
pub const PREFILL_REPLICA_HEADER: &str = "x-kvroute-prefill-replica";

/// Why a request failed, as the report counts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The server answered with this non-2xx status.
    Status(u16),
    /// No connection could be made.
    Connect,
    /// No complete answer within the request timeout.
    Timeout,
    /// The connection failed after it was made, or the stream ended with an error event or
    /// without `[DONE]`.
    Stream,
    /// The answer was not the JSON or SSE it should be.
    Malformed,
    /// The run was stopped while the request was in flight.
    Cancelled,
    /// Due before the run's end (`--duration`), never sent: every slot (`--max-in-flight`)
    /// was held until then.
    Unsent,
}

impl ErrorKind {
    /// The report's key: `http_503`, `connect`, `timeout`, ...
    pub fn label(self) -> String {
        match self {
            ErrorKind::Status(code) => format!("http_{code}"),
            ErrorKind::Connect => "connect".into(),
            ErrorKind::Timeout => "timeout".into(),
            ErrorKind::Stream => "stream".into(),
            ErrorKind::Malformed => "malformed".into(),
            ErrorKind::Cancelled => "cancelled".into(),
            ErrorKind::Unsent => "unsent".into(),
        }
    }
}

/// What a successful request measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Success {
    /// Send to first generated token (streams only).
    pub ttft: Option<Duration>,
    /// Send to the end of the response.
    pub e2e: Duration,
    /// `usage.prompt_tokens` (the workload's length when the server sent no usage).
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// The response had a usage counting its prompt (with or without its cached tokens).
    pub usage: bool,
    /// The router's `x-kvroute-replica` header.
    pub replica: Option<String>,
    /// The router's `x-kvroute-predicted-cached-tokens` header.
    pub predicted_cached_tokens: Option<u64>,
}

impl Success {
    /// `(e2e - ttft) / (completion_tokens - 1)`, when there is a TTFT and a second token.
    pub fn time_per_output_token(&self) -> Option<Duration> {
        let ttft = self.ttft?;
        let more = self.completion_tokens.checked_sub(1).filter(|&n| n > 0)?;
        Some(self.e2e.saturating_sub(ttft) / u32::try_from(more).unwrap_or(u32::MAX))
    }

    /// Its cached tokens; none (0) when its usage counts the prompt without them and the
    /// server is known to report them (`reports`: vLLM, with `--enable-prompt-tokens-details`,
    /// leaves them out of a miss's usage).
    pub fn cached_tokens_given(&self, reports: bool) -> Option<u64> {
        self.cached_tokens.or((self.usage && reports).then_some(0))
    }
}

/// A keep-alive HTTP/1.1 client for completions against one base URL, `http://` or
/// `https://` ([`kvroute_proto::serve::client_config`]).
#[derive(Clone)]
pub struct Client {
    http: HyperClient<HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// `Authorization` of every completion, if any.
    authorization: Option<HeaderValue>,
}

impl Client {
    /// A pooled client; `connect_timeout` bounds each connection attempt. HTTPS trusts the
    /// system's authorities.
    pub fn new(connect_timeout: Duration) -> Self {
        Self::with_tls(connect_timeout, kvroute_proto::serve::system_client_config())
    }

    /// [`Client::new`], HTTPS as `tls` says.
    pub fn with_tls(connect_timeout: Duration, tls: Arc<ClientConfig>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(connect_timeout));
        connector.set_nodelay(true);
        connector.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_tls_config(Arc::unwrap_or_clone(tls))
            .https_or_http()
            .enable_http1()
            .wrap_connector(connector);
        let http = HyperClient::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(90))
            .pool_max_idle_per_host(1024)
            .build(connector);
        Self { http, authorization: None }
    }

    /// The client, sending `authorization` with every completion.
    pub fn authorized(self, authorization: Option<HeaderValue>) -> Self {
        Self { authorization, ..self }
    }

    /// `GET url`, the whole body, within `timeout`.
    pub async fn get(&self, url: &str, timeout: Duration) -> Result<(StatusCode, Bytes), ErrorKind> {
        self.simple(http::Method::GET, url, Bytes::new(), timeout).await
    }

    /// `POST url` with an empty body, the whole answer, within `timeout`.
    pub async fn post_empty(&self, url: &str, timeout: Duration) -> Result<(StatusCode, Bytes), ErrorKind> {
        self.simple(http::Method::POST, url, Bytes::new(), timeout).await
    }

    async fn simple(
        &self,
        method: http::Method,
        url: &str,
        body: Bytes,
        timeout: Duration,
    ) -> Result<(StatusCode, Bytes), ErrorKind> {
        let request = Request::builder()
            .method(method)
            .uri(url)
            .body(Full::new(body))
            .map_err(|_| ErrorKind::Malformed)?;
        let exchange = async {
            let response = self.http.request(request).await.map_err(classify)?;
            let status = response.status();
            let body = response.into_body().collect().await.map_err(|_| ErrorKind::Stream)?.to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(timeout, exchange).await.map_err(|_| ErrorKind::Timeout)?
    }

    /// Sends one request to `{base}{body.path}` and measures it; the whole exchange,
    /// body included, must finish within `timeout`.
    pub async fn complete(
        &self,
        base: &str,
        body: Body,
        stream: bool,
        fallback_prompt_tokens: u64,
        timeout: Duration,
    ) -> Result<Success, ErrorKind> {
        self.complete_naming_replica(base, body, stream, fallback_prompt_tokens, timeout).await.0
    }

    /// [`Client::complete`], also returning the router's `x-kvroute-replica` header when the
    /// response got that far, failed or not (the soak attributes a failed stream to the
    /// replica it was on).
    pub async fn complete_naming_replica(
        &self,
        base: &str,
        body: Body,
        stream: bool,
        fallback_prompt_tokens: u64,
        timeout: Duration,
    ) -> (Result<Success, ErrorKind>, Option<String>) {
        let mut named = None;
        let outcome = self.exchange(base, body, stream, fallback_prompt_tokens, timeout, &mut named).await;
        (outcome, named)
    }

    async fn exchange(
        &self,
        base: &str,
        body: Body,
        stream: bool,
        fallback_prompt_tokens: u64,
        timeout: Duration,
        named: &mut Option<String>,
    ) -> Result<Success, ErrorKind> {
        let mut request = Request::post(format!("{base}{}", body.path))
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if let Some(authorization) = &self.authorization {
            request = request.header(http::header::AUTHORIZATION, authorization.clone());
        }
        let request = request.body(Full::new(body.bytes)).map_err(|_| ErrorKind::Malformed)?;
        let sent = Instant::now();
        let exchange = async {
            let response = self.http.request(request).await.map_err(classify)?;
            let status = response.status();
            let header =
                |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
            let replica = header(REPLICA_HEADER);
            named.clone_from(&replica);
            let predicted_cached_tokens = header(PREDICTED_HEADER).and_then(|v| v.parse().ok());
            // A prompt prefilled elsewhere: the prefill replica's hit, or none known (never the
            // decode replica's usage, which counts the pulled prompt as cached).
            let prefilled = header(PREFILL_REPLICA_HEADER)
                .map(|_| header(PREFILL_CACHED_HEADER).and_then(|v| v.parse::<u64>().ok()));
            let mut body = response.into_body();
            if !status.is_success() {
                // Drain the error body so the connection can be reused.
                let _ = body.collect().await;
                return Err(ErrorKind::Status(status.as_u16()));
            }
            let mut success = Success {
                replica,
                predicted_cached_tokens,
                prompt_tokens: fallback_prompt_tokens,
                ..Success::default()
            };
            let usage = if stream {
                let mut sse = SseState::default();
                while let Some(frame) = body.frame().await {
                    let frame = frame.map_err(|_| ErrorKind::Stream)?;
                    if let Ok(data) = frame.into_data() {
                        sse.feed(data, sent, &mut success)?;
                    }
                }
                if !sse.done {
                    return Err(ErrorKind::Stream);
                }
                sse.usage
            } else {
                let bytes = body.collect().await.map_err(|_| ErrorKind::Stream)?.to_bytes();
                let parsed: Completion = serde_json::from_slice(&bytes).map_err(|_| ErrorKind::Malformed)?;
                parsed.usage.or(parsed.meta_info.map(Usage::from))
            };
            success.e2e = sent.elapsed();
            if let Some(usage) = usage {
                success.prompt_tokens = usage.prompt_tokens().unwrap_or(fallback_prompt_tokens);
                success.completion_tokens = usage.completion_tokens();
                success.cached_tokens = prefilled.unwrap_or_else(|| usage.cached_tokens());
                // A prefill replica's hit not known is no miss: the usage, the decode
                // replica's, says nothing of it (it counts in no hit rate).
                success.usage = usage.prompt_tokens().is_some() && prefilled != Some(None);
            }
            Ok(success)
        };
        tokio::time::timeout(timeout, exchange).await.map_err(|_| ErrorKind::Timeout)?
    }
}

/// `token` as a word: its digits in base 26 as letters, lowest first (`0` is `""`, never a
/// workload token).
fn push_word(out: &mut String, mut token: u32) {
    debug_assert!(token > 0, "token 0 has no word");
    while token > 0 {
        out.push(char::from(b'a' + (token % 26) as u8));
        token /= 26;
    }
}

/// A client error before any response: refused or unreachable is `Connect`.
fn classify(e: hyper_util::client::legacy::Error) -> ErrorKind {
    if e.is_connect() { ErrorKind::Connect } else { ErrorKind::Stream }
}

/// How a request's prompt is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptFormat {
    /// Token ids (`"prompt": [...]`): nobody tokenizes.
    #[default]
    Ids,
    /// Text, one word for each token id (its letters in base 26): the router and the
    /// replicas tokenize it. The built-in tokenizer makes each word one token, so the text
    /// has the ids' length and shares the blocks the ids share, up to hash collisions
    /// (other ids, though). Another tokenizer cuts the words its own way.
    Text,
    /// The same text as the one user message of an Anthropic Messages request
    /// (`POST /v1/messages`): the router and the replicas render it with the chat template
    /// (a few tokens more than the ids) and report hits as `cache_read_input_tokens`.
    Messages,
    /// The same text as the `input` of an OpenAI Responses request (`POST /v1/responses`,
    /// `store: false`, the whole conversation sent each time): rendered with the chat
    /// template, hits reported as `input_tokens_details.cached_tokens`.
    Responses,
    /// The token ids as SGLang's native `/generate` request (`input_ids`,
    /// `sampling_params.max_new_tokens`, no model: the base one): hits reported as
    /// `meta_info.cached_tokens`, in every chunk of a stream.
    Generate,
}

impl PromptFormat {
    /// The path a request in this format goes to.
    pub fn path(self) -> &'static str {
        match self {
            PromptFormat::Ids | PromptFormat::Text => "/v1/completions",
            PromptFormat::Messages => "/v1/messages",
            PromptFormat::Responses => "/v1/responses",
            PromptFormat::Generate => "/generate",
        }
    }
}

/// A request's body and the path it goes to.
#[derive(Clone, Debug)]
pub struct Body {
    pub path: &'static str,
    pub bytes: Bytes,
}

/// The body of a request for `request` in `format`: its prompt and output length.
pub fn request_body(model: &str, request: &WorkloadRequest, stream: bool, format: PromptFormat) -> Body {
    let mut body = String::with_capacity(request.input_len * 6 + 160);
    // Writing to a String cannot fail.
    body.push('{');
    if format != PromptFormat::Generate {
        let _ = write!(body, "\"model\":{},", serde_json::Value::from(model));
    }
    body.push_str(match format {
        PromptFormat::Messages => "\"messages\":[{\"role\":\"user\",\"content\":",
        PromptFormat::Responses => "\"store\":false,\"input\":",
        PromptFormat::Ids | PromptFormat::Text => "\"prompt\":",
        PromptFormat::Generate => "\"input_ids\":",
    });
    let mut prompt = Vec::with_capacity(request.input_len);
    request.write_prompt(&mut prompt);
    match format {
        PromptFormat::Ids | PromptFormat::Generate => {
            body.push('[');
            for (i, token) in prompt.iter().enumerate() {
                if i > 0 {
                    body.push(',');
                }
                let _ = write!(body, "{token}");
            }
            body.push(']');
        }
        PromptFormat::Text | PromptFormat::Messages | PromptFormat::Responses => {
            body.push('"');
            for (i, &token) in prompt.iter().enumerate() {
                if i > 0 {
                    body.push(' ');
                }
                push_word(&mut body, token);
            }
            body.push('"');
        }
    }
    if format == PromptFormat::Messages {
        body.push_str("}]");
    }
    let max_tokens = request.output_len.max(1);
    match format {
        PromptFormat::Generate => {
            let _ =
                write!(body, ",\"sampling_params\":{{\"max_new_tokens\":{max_tokens},\"temperature\":0}}");
        }
        PromptFormat::Responses => {
            let _ = write!(body, ",\"max_output_tokens\":{max_tokens},\"temperature\":0");
        }
        _ => {
            let _ = write!(body, ",\"max_tokens\":{max_tokens},\"temperature\":0");
        }
    }
    match (stream, format) {
        (false, _) => {}
        // A Messages or Responses stream always carries its usage.
        (true, PromptFormat::Messages | PromptFormat::Responses | PromptFormat::Generate) => {
            body.push_str(",\"stream\":true");
        }
        (true, _) => body.push_str(",\"stream\":true,\"stream_options\":{\"include_usage\":true}"),
    }
    body.push('}');
    Body { path: format.path(), bytes: Bytes::from(body) }
}

#[derive(Deserialize)]
struct Completion {
    usage: Option<Usage>,
    meta_info: Option<MetaInfo>,
}

/// SGLang's `/generate` counts (`meta_info`).
#[derive(Clone, Copy, Debug, Deserialize)]
struct MetaInfo {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    cached_tokens: Option<u64>,
}

impl From<MetaInfo> for Usage {
    fn from(meta: MetaInfo) -> Usage {
        Usage {
            prompt_tokens: meta.prompt_tokens,
            completion_tokens: meta.completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens: meta.cached_tokens }),
            ..Usage::default()
        }
    }
}

/// OpenAI's `usage`, its Responses API's (`input_tokens` with `input_tokens_details`), or
/// Anthropic's (the prompt is `input_tokens` + `cache_creation_input_tokens` +
/// `cache_read_input_tokens`).
#[derive(Clone, Copy, Debug, Default, Deserialize)]
struct Usage {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<PromptTokensDetails>,
    input_tokens: Option<u64>,
    input_tokens_details: Option<PromptTokensDetails>,
    output_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
}

impl Usage {
    fn prompt_tokens(&self) -> Option<u64> {
        if self.input_tokens_details.is_some() {
            return self.prompt_tokens.or(self.input_tokens);
        }
        self.prompt_tokens.or_else(|| {
            let cached =
                self.cache_creation_input_tokens.unwrap_or(0) + self.cache_read_input_tokens.unwrap_or(0);
            Some(self.input_tokens? + cached)
        })
    }

    fn completion_tokens(&self) -> u64 {
        self.completion_tokens.or(self.output_tokens).unwrap_or(0)
    }

    fn cached_tokens(&self) -> Option<u64> {
        let details = self.prompt_tokens_details.or(self.input_tokens_details);
        details.and_then(|d| d.cached_tokens).or(self.cache_read_input_tokens)
    }

    /// `newer`, with what it leaves out from `self` (Anthropic's `message_start` has the
    /// prompt's counts, its `message_delta` the output's and perhaps the rest).
    fn updated(self, newer: Usage) -> Usage {
        Usage {
            prompt_tokens: newer.prompt_tokens.or(self.prompt_tokens),
            completion_tokens: newer.completion_tokens.or(self.completion_tokens),
            prompt_tokens_details: newer.prompt_tokens_details.or(self.prompt_tokens_details),
            input_tokens: newer.input_tokens.or(self.input_tokens),
            input_tokens_details: newer.input_tokens_details.or(self.input_tokens_details),
            output_tokens: newer.output_tokens.or(self.output_tokens),
            cache_creation_input_tokens: newer
                .cache_creation_input_tokens
                .or(self.cache_creation_input_tokens),
            cache_read_input_tokens: newer.cache_read_input_tokens.or(self.cache_read_input_tokens),
        }
    }
}

#[derive(Clone, Copy, Debug, Deserialize)]
struct PromptTokensDetails {
    cached_tokens: Option<u64>,
}

/// A chunk (or an Anthropic stream event), read only for what the measurement needs.
#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<serde::de::IgnoredAny>,
    usage: Option<Usage>,
    error: Option<serde::de::IgnoredAny>,
    /// An Anthropic event's type.
    #[serde(rename = "type")]
    kind: Option<String>,
    /// `message_start`'s message (a Responses API `error` event's is its text).
    message: Option<Started>,
    /// A Responses API event's response (the whole of it in the last one).
    response: Option<StartedMessage>,
    /// An SGLang `/generate` chunk's counts so far.
    meta_info: Option<MetaInfo>,
}

#[derive(Deserialize)]
struct StartedMessage {
    usage: Option<Usage>,
}

/// An object with a `usage`, or anything else.
#[derive(Deserialize)]
#[serde(untagged)]
enum Started {
    Message(StartedMessage),
    Other(serde::de::IgnoredAny),
}

/// Incremental SSE parsing: events end with a blank line; only `data:` lines matter.
#[derive(Default)]
struct SseState {
    buf: BytesMut,
    usage: Option<Usage>,
    done: bool,
}

impl SseState {
    fn feed(&mut self, data: Bytes, sent: Instant, success: &mut Success) -> Result<(), ErrorKind> {
        self.buf.extend_from_slice(&data);
        while let Some(end) = find_event_end(&self.buf) {
            let event = self.buf.split_to(end.0);
            self.buf.advance(end.1);
            // An event's data is its `data:` lines joined by newlines (the SSE spec).
            let mut joined = Vec::new();
            for line in event[..].split(|&b| b == b'\n') {
                let Some(payload) = line.strip_prefix(b"data:") else { continue };
                if !joined.is_empty() {
                    joined.push(b'\n');
                }
                joined.extend_from_slice(payload.strip_prefix(b" ").unwrap_or(payload));
            }
            let payload = joined.trim_ascii();
            if payload.is_empty() {
                continue;
            }
            if payload == b"[DONE]" {
                self.done = true;
                continue;
            }
            let chunk: Chunk = serde_json::from_slice(payload).map_err(|_| ErrorKind::Malformed)?;
            if chunk.error.is_some() {
                return Err(ErrorKind::Stream);
            }
            let kind = chunk.kind.as_deref();
            // The Responses API's failures are events of their own.
            if matches!(kind, Some("error" | "response.failed")) {
                return Err(ErrorKind::Stream);
            }
            let native = chunk.meta_info.is_some_and(|m| m.completion_tokens.is_some_and(|c| c > 0));
            let token = !chunk.choices.is_empty()
                || native
                || matches!(kind, Some("content_block_delta" | "response.output_text.delta"));
            if token && success.ttft.is_none() {
                success.ttft = Some(sent.elapsed());
            }
            if matches!(kind, Some("message_stop" | "response.completed" | "response.incomplete")) {
                self.done = true;
            }
            let usage = chunk
                .usage
                .or(chunk.message.and_then(|m| match m {
                    Started::Message(m) => m.usage,
                    Started::Other(_) => None,
                }))
                .or(chunk.response.and_then(|r| r.usage))
                .or(chunk.meta_info.map(Usage::from));
            if let Some(usage) = usage {
                self.usage = Some(self.usage.unwrap_or_default().updated(usage));
            }
        }
        Ok(())
    }
}

/// `(end of the event, length of its separator)` of the first complete event in `buf`.
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| (i, 2));
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| (i, 4));
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(if a.0 <= b.0 { a } else { b }),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod tests {
    use kvroute_proto::openai::{Builtin, Tokenizer};

    use super::*;

    #[test]
    fn sse_frames_split_anywhere_give_ttft_usage_and_done() {
        let text = "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\n\n\
                    data: {\"choices\":[{\"text\":\"b\"}],\"usage\":null}\n\n\
                    data: {\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\
                    \"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\ndata: [DONE]\n\n";
        for cut in [1, 7, 50, text.len() - 3] {
            let mut sse = SseState::default();
            let mut success = Success::default();
            let sent = Instant::now();
            sse.feed(Bytes::copy_from_slice(&text.as_bytes()[..cut]), sent, &mut success).unwrap();
            sse.feed(Bytes::copy_from_slice(&text.as_bytes()[cut..]), sent, &mut success).unwrap();
            assert!(sse.done && success.ttft.is_some(), "cut at {cut}");
            let usage = sse.usage.unwrap();
            assert_eq!((usage.prompt_tokens(), usage.cached_tokens()), (Some(40), Some(32)));
        }
    }

    /// Anthropic's stream: TTFT at the first text delta, usage from `message_start` and
    /// `message_delta` together, done at `message_stop`.
    #[test]
    fn an_anthropic_stream_gives_ttft_usage_and_done() {
        let text = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\
                    \"usage\":{\"input_tokens\":8,\"output_tokens\":0,\"cache_creation_input_tokens\":100,\
                    \"cache_read_input_tokens\":32}}}\n\n\
                    event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0}\n\n\
                    event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\
                    \"delta\":{\"type\":\"text_delta\",\"text\":\"a\"}}\n\n\
                    event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":2}}\n\n\
                    event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";
        for cut in [1, 30, 200, text.len() - 3] {
            let mut sse = SseState::default();
            let mut success = Success::default();
            let sent = Instant::now();
            sse.feed(Bytes::copy_from_slice(&text.as_bytes()[..cut]), sent, &mut success).unwrap();
            assert!(!sse.done || cut == text.len() - 3, "cut at {cut}");
            sse.feed(Bytes::copy_from_slice(&text.as_bytes()[cut..]), sent, &mut success).unwrap();
            assert!(sse.done && success.ttft.is_some(), "cut at {cut}");
            let usage = sse.usage.unwrap();
            assert_eq!(
                (usage.prompt_tokens(), usage.cached_tokens(), usage.completion_tokens()),
                (Some(140), Some(32), 2),
                "the prompt counts the tokens written to the cache"
            );
        }
        let mut sse = SseState::default();
        let error =
            Bytes::from_static(b"event: error\ndata: {\"type\":\"error\",\"error\":{\"message\":\"x\"}}\n\n");
        assert_eq!(sse.feed(error, Instant::now(), &mut Success::default()), Err(ErrorKind::Stream));
    }

    /// An event's data may span several `data:` lines, joined by newlines (the SSE spec).
    #[test]
    fn an_events_data_lines_are_joined() {
        let text = "data: {\"choices\":[{\"text\":\"a\"}],\ndata: \"usage\":null}\n\ndata: [DONE]\n\n";
        let mut sse = SseState::default();
        let mut success = Success::default();
        sse.feed(Bytes::from_static(text.as_bytes()), Instant::now(), &mut success).unwrap();
        assert!(sse.done && success.ttft.is_some());
    }

    #[test]
    fn an_error_event_fails_the_stream() {
        let mut sse = SseState::default();
        let event = Bytes::from_static(b"data: {\"error\":{\"message\":\"x\"}}\n\n");
        assert_eq!(sse.feed(event, Instant::now(), &mut Success::default()), Err(ErrorKind::Stream));
    }

    #[test]
    fn the_body_carries_the_token_prompt() {
        let request = WorkloadRequest {
            arrival: Duration::ZERO,
            input_len: 600,
            output_len: 7,
            hash_ids: vec![1, 2],
            segments: Vec::new(),
        };
        let body = request_body("m", &request, true, PromptFormat::Ids);
        assert_eq!(body.path, "/v1/completions");
        let body: serde_json::Value = serde_json::from_slice(&body.bytes).unwrap();
        let prompt: Vec<u32> = serde_json::from_value(body["prompt"].clone()).unwrap();
        assert_eq!(prompt, request.prompt());
        assert_eq!(body["max_tokens"], 7);
        assert_eq!(body["stream_options"]["include_usage"], true);
        // As a Messages request: the text as the one user message.
        let messages = request_body("m", &request, true, PromptFormat::Messages);
        assert_eq!(messages.path, "/v1/messages");
        let messages: serde_json::Value = serde_json::from_slice(&messages.bytes).unwrap();
        let text = serde_json::from_slice::<serde_json::Value>(
            &request_body("m", &request, false, PromptFormat::Text).bytes,
        )
        .unwrap()["prompt"]
            .clone();
        assert_eq!(messages["messages"], serde_json::json!([{"role": "user", "content": text}]));
        assert_eq!((messages["max_tokens"].as_u64(), messages["stream"].as_bool()), (Some(7), Some(true)));
        // As a Responses request: the text as the input, nothing stored.
        let responses = request_body("m", &request, false, PromptFormat::Responses);
        assert_eq!(responses.path, "/v1/responses");
        let responses: serde_json::Value = serde_json::from_slice(&responses.bytes).unwrap();
        assert_eq!((&responses["input"], &responses["store"]), (&text, &serde_json::json!(false)));
        assert_eq!(responses["max_output_tokens"], 7);
        // As SGLang's /generate: the ids, no model.
        let native = request_body("m", &request, true, PromptFormat::Generate);
        assert_eq!(native.path, "/generate");
        let native: serde_json::Value = serde_json::from_slice(&native.bytes).unwrap();
        let keys: Vec<&str> = native.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["input_ids", "sampling_params", "stream"]);
        assert_eq!(native["input_ids"], body["prompt"]);
        assert_eq!(native["sampling_params"], serde_json::json!({"max_new_tokens": 7, "temperature": 0}));
    }

    /// SGLang's `/generate` stream: TTFT at the first chunk, its counts from the last.
    #[test]
    fn an_sglang_stream_gives_ttft_usage_and_done() {
        let chunk = |n: u64, done: bool| {
            let finish = if done { format!("{{\"type\":\"length\",\"length\":{n}}}") } else { "null".into() };
            format!(
                "data: {{\"text\":\"x\",\"output_ids\":[1],\"meta_info\":{{\"id\":\"r\",\"finish_reason\":{finish},\
                 \"prompt_tokens\":40,\"completion_tokens\":{n},\"cached_tokens\":32}}}}\n\n"
            )
        };
        let text = format!("{}{}data: [DONE]\n\n", chunk(1, false), chunk(2, true));
        let mut sse = SseState::default();
        let mut success = Success::default();
        sse.feed(Bytes::from(text), Instant::now(), &mut success).unwrap();
        assert!(sse.done && success.ttft.is_some());
        let usage = sse.usage.unwrap();
        assert_eq!(
            (usage.prompt_tokens(), usage.cached_tokens(), usage.completion_tokens()),
            (Some(40), Some(32), 2)
        );
        let whole: Completion = serde_json::from_str(chunk(2, true).trim_start_matches("data: ")).unwrap();
        let usage = whole.usage.or(whole.meta_info.map(Usage::from)).unwrap();
        assert_eq!(usage.cached_tokens(), Some(32));
    }

    /// The Responses API's stream: TTFT at the first text delta, usage from the last event.
    #[test]
    fn a_responses_stream_gives_ttft_usage_and_done() {
        let text = "event: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"usage\":null},\"sequence_number\":0,\"type\":\"response.created\"}\n\n\
                    event: response.output_text.delta\ndata: {\"delta\":\"a\",\"sequence_number\":1,\"type\":\"response.output_text.delta\"}\n\n\
                    event: response.incomplete\ndata: {\"response\":{\"id\":\"resp_1\",\"usage\":{\"input_tokens\":40,\
                    \"input_tokens_details\":{\"cached_tokens\":32},\"output_tokens\":1}},\"sequence_number\":2,\"type\":\"response.incomplete\"}\n\n";
        let mut sse = SseState::default();
        let mut success = Success::default();
        sse.feed(Bytes::from(text), Instant::now(), &mut success).unwrap();
        assert!(sse.done && success.ttft.is_some());
        let usage = sse.usage.unwrap();
        assert_eq!((usage.prompt_tokens(), usage.cached_tokens()), (Some(40), Some(32)));
        let failed = Bytes::from_static(b"event: error\ndata: {\"message\":\"x\",\"type\":\"error\"}\n\n");
        assert_eq!(SseState::default().feed(failed, Instant::now(), &mut success), Err(ErrorKind::Stream));
    }

    /// The built-in tokenizer's ids of `request`'s text body.
    fn text_tokens(request: &WorkloadRequest) -> Vec<u32> {
        let body: serde_json::Value =
            serde_json::from_slice(&request_body("m", request, false, PromptFormat::Text).bytes).unwrap();
        assert_eq!(body["max_tokens"], request.output_len.max(1));
        Builtin.encode(body["prompt"].as_str().expect("a text prompt"), false).unwrap()
    }

    #[test]
    fn a_text_prompt_is_a_token_a_word_and_shares_what_the_ids_share() {
        let req = |input_len, hash_ids| WorkloadRequest {
            arrival: Duration::ZERO,
            input_len,
            output_len: 3,
            hash_ids,
            segments: Vec::new(),
        };
        // Two prompts sharing their first 512-token block, then not; a third sharing both.
        let a = text_tokens(&req(1100, vec![1, 2, 3]));
        let b = text_tokens(&req(700, vec![1, 9]));
        let c = text_tokens(&req(1030, vec![1, 2, 4]));
        assert_eq!((a.len(), b.len(), c.len()), (1100, 700, 1030));
        let shared = |x: &[u32], y: &[u32]| x.iter().zip(y).take_while(|(p, q)| p == q).count();
        // Equal exactly as far as the ids are (two different words get the same id once in
        // 32 752; not where these prompts part).
        assert_eq!(shared(&a, &b), 512);
        assert_eq!(shared(&a, &c), 1024);
        // Every token id has its own word.
        let mut words = String::new();
        for token in [16, 25, 26, 27, 675, 676, 32_767] {
            words.clear();
            push_word(&mut words, token);
            let back = words.bytes().rev().fold(0, |n, b| n * 26 + u32::from(b - b'a'));
            assert_eq!(back, token, "{words}");
        }
    }
}
