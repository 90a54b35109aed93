//! The OpenAI-compatible reverse proxy.
//!
//! | path | what the router does |
//! |---|---|
//! | `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/messages` (Anthropic's API) and `POST /v1/responses` (OpenAI's Responses API), the last two decided as the chat request vLLM makes of them | reads the body (up to `--max-body-bytes`), decides ([`route`]), forwards the original bytes ([`forward`]); a Responses request that continues a stored response goes to the replica that stored it ([`responses`]) |
//! | `POST /generate` (SGLang's native API) | decided as the completion it amounts to (`kvroute_proto::openai::request::sglang`), among replicas that serve it (SGLang's and kvroute's agents, not vLLM's), and forwarded as any completion is |
//! | `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` | streamed to the replica that stored the response ([`responses`]); without a place under the router's limits unless it is a resumed stream or of an id the router does not know |
//! | other `/v1/*`, and the engines' own paths outside `/v1` that do not generate (`/tokenize`, `/rerank`, ...: [`paths`]) | streams the request to the least-loaded eligible replica (one of the router's own paths spelled otherwise is refused) |
//! | `GET /v1/models` | the fleet's model (with the fields a healthy replica lists for it: `max_model_len`, `root`, `owned_by`) and LoRA adapters |
//! | `OPTIONS` on the paths above (a browser's CORS preflight) | streamed to the least-loaded eligible replica, so the fleet's CORS policy answers it; the router's own answers (its errors, `/v1/models`) carry `--allowed-origins`' ([`cors`]) |
//! | `POST /v1/load_lora_adapter`, `/v1/unload_lora_adapter` (and SGLang's spellings) | sent to every replica, with `--lora-updates` ([`lora`]) |
//! | `GET /health` | 200 while every HTTP thread runs its tick ([`ProxyState::stalled_threads`]), else 503 |
//! | `GET /ready` | 200 once discovery listed the replicas and each completed its first event sync ([`ProxyState::ready`]) |
//! | `GET /metrics` | Prometheus text: proxy and ingest metrics |
//! | an HTTP/1.1 `GET` for a WebSocket (`Upgrade: websocket`, `Connection: upgrade`; vLLM's `/v1/realtime`) on a path that passes through, or on `/v1/responses` (vLLM's Responses API over a WebSocket) | tunnelled to the least-loaded eligible replica ([`tunnel`]) |
//!
//! Layout: [`access`] (the access log), [`background`] (Responses generated in the background), [`body`] (pass-through bodies, usage sniffing), [`control`] (the router's own requests to replicas), [`cors`] (the router's own answers' CORS fields), [`error`] (every error the router answers), [`forward`], [`http1`] (HTTP/1.1 to the replicas), [`idle`] (bodies' idle timeouts), [`key_file`] (`--api-key-file`), [`live`] (the settings a reload changes), [`lora`] (adapters loaded at run time), [`paths`] (the router's own paths), [`pool`] (upstream
//! connections, one pool per HTTP thread), [`prompts`] (tokenization modes), [`queue`] (requests waiting for room), [`responses`] (which replica stored each Responses API response), [`route`] (the decision path), [`stalls`] (responses a client stopped taking), [`tunnel`] (WebSockets), [`upload`] (clients' request
//! bodies: stalls, and what a failed one means), [`upstream`] (per-replica load and health), [`waiters`] (requests waiting for a replica's room).

pub mod access;
pub mod background;
pub mod body;
pub mod connect;
pub mod control;
pub mod cors;
pub mod disagg;
pub mod error;
pub mod forward;
pub mod health;
pub mod http1;
pub mod idle;
pub mod key_file;
pub mod live;
pub mod lora;
pub mod opening;
pub mod paths;
pub mod per_key;
pub mod pool;
pub mod prompts;
pub mod queue;
pub mod replica_key;
pub mod responses;
pub mod route;
pub mod stalls;
pub mod tunnel;
pub mod upload;
pub mod upstream;
pub mod waiters;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use kvroute_proto::openai::request::sglang::GENERATE_PATH;
use kvroute_proto::openai::{Endpoint, RequestError};
use kvroute_proto::serve::{Heartbeats, Limits};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use xxhash_rust::xxh3::xxh3_64;

use crate::fleet::{Fleet, Member};
use crate::metrics::ErrorLabel;
use body::{ProxyBody, full};
use error::ProxyError;
use forward::{Admitted, ForwardConfig, Sending};
use http1::Outgoing;
use pool::Pool;
use responses::Continuation;
use route::Decider;

/// Everything the request path shares.
pub struct ProxyState {
    pub decider: Decider,
    /// Makes an upstream connection pool: one per HTTP thread.
    pub new_pool: Box<dyn Fn() -> Pool + Send + Sync>,
    pub forward: ForwardConfig,
    pub registry: Arc<Registry>,
    /// The bounds and keys requests are admitted by, as a reload leaves them.
    pub admission: live::Live<live::Admission>,
    /// `--api-key-file`: every change to the admission's keys goes through it.
    pub key_file: Arc<key_file::KeyFile>,
    /// Global in-flight limit: a request that cannot get a permit waits in `queue`.
    pub in_flight: Arc<Semaphore>,
    /// Each client key's requests in flight (`--max-in-flight-per-key`: [`per_key`]).
    pub per_key: Arc<per_key::PerKey>,
    /// Requests waiting for room ([`queue`]).
    pub queue: queue::Queue,
    /// The served base model (its LoRA adapters are the tokenization's).
    pub base_model: String,
    /// LoRA adapter changes through the router ([`lora`]).
    pub lora: lora::Updates,
    /// Replica discovery (static mode counts as listed from the start).
    pub discovery: crate::discovery::Discovery,
    /// Set once the first sync completed: `/ready` stays true from then on.
    pub(crate) synced_once: AtomicBool,
    /// The proxy's HTTP threads' ticks.
    pub heartbeats: Heartbeats,
    /// Who may read the router's own answers ([`cors`]).
    pub allowed_origins: cors::AllowedOrigins,
    /// The proxy listener's TLS, if it serves HTTPS (`--tls-cert`): reloaded in place.
    pub tls: Option<kvroute_proto::serve::Tls>,
    /// The TLS of connections to `https://` replicas: reloaded in place.
    pub replica_tls: connect::ReplicaTls,
    /// `--replica-api-key-file`, if named: its key is `forward.replica_authorization`.
    pub replica_key_file: replica_key::ReplicaKeyFile,
    /// The router's shutdown: open WebSocket tunnels end with it ([`tunnel`]).
    pub shutdown: CancellationToken,
}

/// An HTTP thread that has not ticked for this long is stuck: `/health` fails.
pub const STALLED_AFTER: Duration = Duration::from_secs(10);

impl ProxyState {
    pub fn fleet(&self) -> &Fleet {
        &self.decider.fleet
    }

    /// The proxy's HTTP threads that have not ticked for [`STALLED_AFTER`]: stuck in a
    /// blocking call or a loop, with their connections. A probe on the proxy's port reaches
    /// one thread, a stuck one never, so it could not tell.
    pub fn stalled_threads(&self) -> Vec<usize> {
        self.heartbeats.stalled(std::time::Instant::now(), STALLED_AFTER)
    }

    /// Ready to route: discovery has listed the replicas once, and every replica then
    /// completed its first event sync ([`Fleet::ready`]). Once ready, always ready: a
    /// replica that joins later (a scale-up, a pod back under a new address) is routed on
    /// load until its own sync, and one replica whose events cannot be reached must not take
    /// every router out of its Service. Each replica's sync shows in `ListReplicas`.
    pub fn ready(&self) -> bool {
        if self.synced_once.load(Ordering::Relaxed) {
            return true;
        }
        let ready = self.discovery.is_listed() && self.fleet().ready();
        if ready {
            self.synced_once.store(true, Ordering::Relaxed);
        }
        ready
    }
}

/// The answer to `GET /health` or `GET /ready` (any other path: 404), on the proxy's port or
/// the health port ([`serve_probes`]).
fn probe(state: &ProxyState, path: &str) -> Response<ProxyBody> {
    let (status, text) = match path {
        "/health" => match state.stalled_threads() {
            stalled if stalled.is_empty() => (StatusCode::OK, String::new()),
            stalled => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("HTTP threads {stalled:?} have not run for {} s or more", STALLED_AFTER.as_secs()),
            ),
        },
        "/ready" if state.ready() => (StatusCode::OK, "ready".into()),
        "/ready" => (StatusCode::SERVICE_UNAVAILABLE, "waiting for the first sync of every replica".into()),
        _ => (StatusCode::NOT_FOUND, String::new()),
    };
    let mut response = Response::new(full(Bytes::from(text)));
    *response.status_mut() = status;
    response
}

/// Serves `GET /health`, `GET /ready` and `GET /metrics` on `listener` until `shutdown` fires:
/// a listener of its own, outside the proxy's connection limit, so that liveness probes are
/// answered while the proxy is full (a probe that waits behind the limit would have the router
/// restarted under load, dropping every connection and the index with it), and plain HTTP
/// when the proxy serves TLS (the kubelet's probes and Prometheus' scrapes).
pub async fn serve_probes(listener: TcpListener, state: Arc<ProxyState>, shutdown: CancellationToken) {
    // Probes only: a few connections at a time, none held long.
    let limits =
        Limits { max_connections: 256, header_read_timeout: Duration::from_secs(5), ..Limits::default() };
    let handler = move |req: Request<Incoming>| {
        let state = state.clone();
        async move {
            match (req.method(), req.uri().path()) {
                (&Method::GET, "/metrics") => metrics(&state),
                (&Method::HEAD, "/metrics") => headers_only(metrics(&state)),
                (&Method::GET, path) => probe(&state, path),
                (&Method::HEAD, path) => headers_only(probe(&state, path)),
                _ => {
                    let mut response = Response::new(full(Bytes::new()));
                    *response.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
                    response
                }
            }
        }
    };
    kvroute_proto::serve::serve_with(listener, handler, limits, None, shutdown).await;
}

/// Serves the proxy on `listener` with `threads` threads within `limits` (over TLS with
/// [`ProxyState::tls`]) until `shutdown` fires, then drains open requests; fails if its
/// threads cannot start. Each thread forwards through an upstream connection
/// pool of its own ([`kvroute_proto::serve::serve_on_threads`]).
pub async fn serve(
    listener: TcpListener,
    threads: usize,
    state: Arc<ProxyState>,
    limits: Limits,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let make_handler = || {
        let state = state.clone();
        let pool = Arc::new((state.new_pool)());
        tokio::spawn(pool::sweep_while_held(Arc::downgrade(&pool)));
        move |req| handle(state.clone(), pool.clone(), req)
    };
    let (heartbeats, tls) = (state.heartbeats.clone(), state.tls.clone());
    kvroute_proto::serve::serve_on_threads(listener, threads, make_handler, limits, tls, heartbeats, shutdown)
        .await
}

async fn handle(state: Arc<ProxyState>, pool: Arc<Pool>, req: Request<Incoming>) -> Response<ProxyBody> {
    let request_id = request_id(&req);
    let client = error::Client::of_path(req.uri().path());
    // For the access log's lines, only when it is on (a clock read is not free).
    let received = state.forward.access_log.then(|| access::Arrival {
        at: tokio::time::Instant::now(),
        client: req.extensions().get::<kvroute_proto::serve::Peer>().map(|peer| peer.0),
    });
    let asked = state.forward.access_log.then(|| (req.method().clone(), req.uri().path().to_owned()));
    // Logs the request if the client leaves before it has an answer (this future dropped).
    let own_probe = is_probe(req.uri().path());
    let counted = (!own_probe).then_some(&state.decider.metrics);
    let mut unanswered = access::Unanswered::new(&request_id, asked.as_ref(), received, counted);
    // A browser's request: whether the router answers its path itself.
    let origin = req.headers().get(header::ORIGIN).map(|o| (o.clone(), answers_itself(req.uri().path())));
    // A HEAD the router answers itself, or refuses (a forwarded one's answer has no body).
    let head = req.method() == Method::HEAD;
    let own_head = head && answers_itself(req.uri().path());
    let mut held = None;
    let answered = dispatch(&state, &pool, (req, &mut held), &request_id, received).await;
    // The key's place lasts as long as the answer's body (a background response's, until the
    // response is final: [`background`]).
    let answered = match held {
        Some(held) => answered.map(|response| holding(response, held)),
        None => answered,
    };
    if let Err(ProxyError::ClientLeft) = answered {
        // Counted and logged as abandoned, as if this future had been dropped: no error of
        // the router's or the request's, and no answer can reach the client.
        drop(unanswered);
        return ProxyError::ClientLeft.into_response_for(&request_id, client);
    }
    unanswered.answered();
    let own = answered.is_err() || origin.as_ref().is_some_and(|(_, own)| *own);
    let own_head = own_head || head && answered.is_err();
    let mut response = match answered {
        Ok(response) => response,
        Err(e) => {
            state.decider.metrics.errors.get_or_create(&ErrorLabel { kind: e.label() }).inc();
            if e.status().is_server_error() && !matches!(e, ProxyError::NotImplemented(_)) {
                tracing::warn!(error = %e, request_id, "request failed");
            }
            if let (Some((method, path)), Some(received)) = (&asked, received) {
                access::refused(&request_id, method, path, received, &e);
            }
            e.into_response_for(&request_id, client)
        }
    };
    if let Some((origin, _)) = origin.as_ref().filter(|_| own) {
        state.allowed_origins.apply(Some(origin), response.headers_mut());
    }
    // The router's own probes and scrapes are not requests to the fleet: a readiness
    // probe's 503s before the first sync would count as failed requests.
    if !own_probe {
        state.decider.metrics.count_response(response.status().as_u16());
    }
    match own_head {
        true => headers_only(response),
        false => response,
    }
}

/// `response`, holding `held` until its body ends (or is dropped).
fn holding(response: Response<ProxyBody>, held: per_key::KeyPlace) -> Response<ProxyBody> {
    response.map(|body| {
        body.map_frame(move |frame| {
            let _held = &held;
            frame
        })
        .boxed_unsync()
    })
}

/// The answer to a HEAD: the headers, with the length the body would have had, and no body.
/// (hyper leaves a HEAD's body out over HTTP/1 only; over HTTP/2 it sends it, and clients
/// reset the stream.)
fn headers_only(response: Response<ProxyBody>) -> Response<ProxyBody> {
    use hyper::body::Body;
    let (mut parts, body) = response.into_parts();
    if let Some(len) = body.size_hint().exact()
        && !parts.headers.contains_key(header::CONTENT_LENGTH)
    {
        parts.headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    }
    Response::from_parts(parts, full(Bytes::new()))
}

/// The answer to `req`; its key's place under `--max-in-flight-per-key`, if it takes one, put
/// in `held`.
async fn dispatch(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    (mut req, held): (Request<Incoming>, &mut Option<per_key::KeyPlace>),
    request_id: &str,
    received: Option<access::Arrival>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let path = req.uri().path().to_owned();
    let method = req.method().clone();
    // hyper takes off the chunking and leaves the body in any coding before it (`gzip,
    // chunked`): passed on, the replica would take the compressed bytes for the body.
    if let Some(coding) = foreign_transfer_coding(req.headers()) {
        return Err(ProxyError::NotImplemented(format!(
            "transfer coding {coding:?} is not supported; send the body as it is, chunked or with a Content-Length"
        )));
    }
    // The router's own LoRA paths reach every replica, SGLang's spellings outside `/v1` too.
    let authorization = req.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
    let admission = state.admission.get();
    let key = admission.key_of(&method, &path, authorization)?;
    // Its key's place ([`per_key`]), which its answer holds ([`holding`]): not for the fleet's
    // model list, which the router answers itself, nor for a brief ask about a stored response
    // the router knows ([`stored_response`]).
    let lists_models = matches!(method, Method::GET | Method::HEAD) && path == "/v1/models";
    let takes_none = lists_models || brief_about_known(state, &method, req.uri());
    if let (Some(key), limit @ 1.., false) = (key, admission.max_in_flight_per_key, takes_none) {
        let place =
            per_key::KeyPlace::new(state.per_key.try_hold(key, limit).ok_or(ProxyError::KeyLimit { limit })?);
        // Its place under --max-in-flight takes it, once it has one ([`admit`]).
        req.extensions_mut().insert(place.clone());
        *held = Some(place);
    }
    drop(admission);
    if method == Method::GET
        && req.version() == http::Version::HTTP_11
        && asks_websocket(req.headers())
        && (path == responses::RESPONSES_PATH
            || paths::allowed(&path).is_none()
                && paths::passes_through(&path)
                && responses::target(&path).is_none())
    {
        // Passed on as other requests are, without its `Upgrade` (hop-by-hop), it would
        // reach the replica as a plain request and be refused there as an unknown path.
        // (vLLM serves the Responses API over a WebSocket too, at its path: by load, as its
        // responses are kept where the session runs.)
        paths::check_passthrough(&path)?;
        tunnel::check_handshake(req.headers())?;
        let line = queue::Line::default();
        // The session holds its key's place as it holds its place under --max-in-flight (its
        // handshake's answer ends at once).
        let admitted = admit(state, (request_id, received), &line, &req).await?;
        let members = with_room(state, &line, || by_load(state, request_id, None, Takes::ANY)).await?;
        return Box::pin(tunnel::open(state, pool, req, members, admitted)).await;
    }
    // The forwarding futures are boxed: hyper keeps each request's future in place, moving
    // it in whole, and every byte of them would be copied for every request (they are
    // kilobytes), whichever path the request takes.
    match (method, path.as_str()) {
        (Method::POST, "/v1/completions") => {
            Box::pin(routed(state, pool, req, Endpoint::Completions, (request_id, received))).await
        }
        (Method::POST, "/v1/chat/completions") => {
            Box::pin(routed(state, pool, req, Endpoint::ChatCompletions, (request_id, received))).await
        }
        (Method::POST, "/v1/messages") => {
            Box::pin(routed(state, pool, req, Endpoint::Messages, (request_id, received))).await
        }
        (Method::POST, responses::RESPONSES_PATH) => {
            Box::pin(routed(state, pool, req, Endpoint::Responses, (request_id, received))).await
        }
        (Method::POST, GENERATE_PATH) => {
            Box::pin(routed(state, pool, req, Endpoint::Generate, (request_id, received))).await
        }
        // A browser's preflight of an API path goes to a replica: the fleet's CORS policy
        // answers it (vLLM's allows every origin by default), whoever stored a response.
        (Method::OPTIONS, p)
            if (p.starts_with("/v1/") || p == GENERATE_PATH)
                && (paths::allowed(p).is_some() || responses::target(p).is_some()) =>
        {
            paths::check_passthrough(p)?;
            Box::pin(passthrough(state, pool, req, (request_id, received))).await
        }
        (_, p) if let Some(responses::Target::Stored(id)) = responses::target(p) => {
            paths::check_passthrough(p)?;
            // The replica's server would answer it with a redirect to its own address.
            if p.ends_with('/') {
                return Err(ProxyError::BadPath(format!("the path {p} ends with a slash; send it without")));
            }
            let id = responses::decoded(id);
            Box::pin(stored_response(state, pool, req, &id, (request_id, received))).await
        }
        (Method::GET | Method::HEAD, "/v1/models") => Ok(json(StatusCode::OK, models(state))),
        (Method::POST, p) if let Some(change) = lora::route(p) => {
            // Refused or over the limit before its body is read (and `100 Continue` sent).
            lora::check_enabled(state)?;
            check_length(state, req.headers())?;
            let admitted = admit(state, (request_id, received), &queue::Line::default(), &req).await?;
            let (parts, body) = req.into_parts();
            let body = read_body(body, state.forward.max_body_bytes, state.forward.idle_timeout).await?;
            Box::pin(lora::fan_out(state, pool, change, (parts, body), (request_id, admitted.slot))).await
        }
        (Method::GET | Method::HEAD, "/health" | "/ready") => Ok(probe(state, &path)),
        (Method::GET | Method::HEAD, "/metrics") => Ok(metrics(state)),
        (method, p) => match paths::allowed(p) {
            Some(allow) => Err(ProxyError::MethodNotAllowed { method: method.to_string(), allow }),
            None if paths::passes_through(p) => {
                paths::check_passthrough(p)?;
                Box::pin(passthrough(state, pool, req, (request_id, received))).await
            }
            None => Err(ProxyError::NotFound(path)),
        },
    }
}

/// A completion, chat, Messages, Responses or `/generate` request: read, decide, forward. A Responses
/// request that continues a stored response goes to the replica that stored it
/// ([`responses`]).
async fn routed(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    req: Request<Incoming>,
    endpoint: Endpoint,
    arrived: (&str, Option<access::Arrival>),
) -> Result<Response<ProxyBody>, ProxyError> {
    check_length(state, req.headers())?;
    let line = queue::Line::default();
    let admitted = admit(state, arrived, &line, &req).await?;
    // As they are once it is admitted (it may have waited through a reload).
    let limits = state.admission.get().limits;
    let (parts, body) = req.into_parts();
    let body = read_body(body, state.forward.max_body_bytes, state.forward.idle_timeout).await?;
    let keeps = match endpoint {
        Endpoint::Responses => responses::Keeps::asked_in(&body),
        _ => responses::Keeps::Nothing,
    };
    if keeps == responses::Keeps::Background {
        return apart(state, pool, endpoint, (parts, body), admitted, (line, limits)).await;
    }
    sent_on(state, pool, endpoint, (parts, body), admitted, (&line, &limits), keeps).await
}

/// [`routed`] for a Responses request generated in the background: decided and sent apart
/// from its client, in a task of its own, which reads the answer's beginning before it hands
/// it on. A client that leaves (its connection closed as soon as the request went, its
/// stream reset) would otherwise drop the request's forward before the answer showed the
/// response's id, and the replica would generate on holding none of the router's places
/// ([`background`]). Once the task has the id, a client gone leaves the places held.
async fn apart(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    endpoint: Endpoint,
    (parts, body): (http::request::Parts, bytes::Bytes),
    admitted: Admitted<'_>,
    (mut line, limits): (queue::Line, route::RequestLimits),
) -> Result<Response<ProxyBody>, ProxyError> {
    let (state, pool) = (state.clone(), pool.clone());
    let (request_id, slot, received) = (admitted.request_id.to_owned(), admitted.slot, admitted.received);
    // A request whose client left while it waits for room is given up, as any other (it
    // would be sent to generate for nobody, holding its key's places); one whose client leaves
    // as it is decided, or after, is sent.
    let gone = CancellationToken::new();
    let _gone_with_this = gone.clone().drop_guard();
    line.follow(gone);
    // Drained at shutdown as its connection is.
    let background = parts.extensions.get::<kvroute_proto::serve::Background>().cloned();
    let task = async move {
        let admitted = Admitted { request_id: &request_id, slot, received };
        let sent = (&line, &limits);
        let keeps = responses::Keeps::Background;
        match sent_on(&state, &pool, endpoint, (parts, body), admitted, sent, keeps).await {
            // Dropped untaken (its client left), the answer's places are held by its id.
            Ok(response) => Ok(background::with_id_read(response).await),
            failed => failed,
        }
    };
    let task = match background {
        Some(background) => background.spawn(task),
        None => tokio::spawn(task),
    };
    match task.await.map_err(tokio::task::JoinError::try_into_panic) {
        Ok(answer) => answer,
        Err(Ok(panic)) => std::panic::resume_unwind(panic),
        Err(Err(_)) => Err(ProxyError::Unavailable("the router is shutting down".into())),
    }
}

/// [`routed`]'s request, its body read: decided and sent.
async fn sent_on(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    endpoint: Endpoint,
    (parts, body): (http::request::Parts, bytes::Bytes),
    admitted: Admitted<'_>,
    (line, limits): (&queue::Line, &route::RequestLimits),
    keeps: responses::Keeps,
) -> Result<Response<ProxyBody>, ProxyError> {
    let (waiters, metrics) = (state.fleet().waiters(), &state.decider.metrics);
    let goes_to = |plan: &route::Plan| plan.chosen().map(|chosen| chosen.member.replica.id);
    // Tokenized once, decided again each time it is woken to find room.
    let decided = match state.decider.prepare(endpoint, &body).await {
        Ok(prepared) => {
            line.set_priority(prepared.priority);
            let decide = || std::future::ready(state.decider.decide_prepared(&prepared, limits));
            let decided = state.queue.until_room(waiters, (line, metrics), decide, goes_to).await;
            decided.map(|plan| (plan, prepared))
        }
        Err(e) => Err(e),
    };
    match decided {
        Ok((plan, prepared)) => {
            let mut prefilling = disagg::Prefilling::new(state, plan);
            prefilling.plan.keeps_response = keeps;
            let (arrived, sent) = ((admitted.request_id, admitted.received), (&parts, &body));
            let prefilled = disagg::prefill(
                (state, pool),
                (&prepared, &mut prefilling.plan),
                endpoint,
                sent,
                arrived,
                line,
            );
            let decode = match prefilled.await {
                Ok(decode) => decode,
                Err(failure) => return failure.answer(),
            };
            let plan = prefilling.sent();
            let (forward, decider, queue) = (&state.forward, &state.decider, (&state.queue, line));
            let decoded =
                forward::routed(pool, forward, decider, plan, (parts, decode.body), admitted, queue);
            match decode.alongside {
                Some(alongside) => {
                    let together = disagg::together(decoded, alongside).await;
                    // A decode dropped before its replica answered (its prefill failed): its
                    // credit there ends now, not after the TTL (its replica drops it too).
                    if together.decode_dropped {
                        disagg::let_go(state, plan);
                    }
                    together.answer
                }
                None => decoded.await,
            }
        }
        // A prompt given as embeddings (vLLM's `prompt_embeds`): no token ids to route on, so
        // to the least-loaded replica (one with its LoRA adapter), within the router's limits.
        Err(ProxyError::BadRequest(RequestError::PromptEmbeds(asked))) => {
            limits.check_completion(asked.max_tokens, endpoint)?;
            line.set_priority(asked.priority);
            let adapter = state.decider.adapter(&asked.model);
            // A completion, sent without a bootstrap room ([`disagg`]).
            let takes = Takes { roomless: true, generate: endpoint == Endpoint::Generate };
            let members =
                with_room(state, line, || by_load(state, admitted.request_id, adapter, takes)).await?;
            let body = disagg::without_own_params_if_split(state.fleet(), body);
            let sending = Sending {
                body: Outgoing::Full(body),
                uploaded: None,
                sequences: asked.sequences,
                prompt_tokens: 0,
                prefill_tokens: 0,
                keeps_response: responses::Keeps::Nothing,
                rank: None,
            };
            forward::to_replica(pool, &state.forward, &state.decider, &members, parts, sending, admitted)
                .await
        }
        Err(ProxyError::BadRequest(RequestError::StoredConversation)) => {
            let continuation = Continuation::read(&state.decider, &body, limits).await?;
            let (member, rank) = find_owner(state, pool, &parts.headers, &continuation.id).await?;
            // Only the replica that stored the response can continue it: it waits for room there.
            let owner = member.replica.id;
            line.set_priority(continuation.priority);
            let room = || owner_has_room(state, &member);
            state.queue.until_room(waiters, (line, metrics), room, |_| Some(owner)).await?;
            let (prompt_tokens, prefill_tokens) = continuation.load_on(&member);
            let sending = Sending {
                body: Outgoing::Full(body),
                uploaded: None,
                sequences: 1,
                prompt_tokens,
                prefill_tokens,
                keeps_response: continuation.store,
                rank,
            };
            let owner = std::slice::from_ref(&member);
            forward::to_replica(pool, &state.forward, &state.decider, owner, parts, sending, admitted).await
        }
        Err(e) => Err(e),
    }
}

/// Whether `method` `uri` is a brief ask about a stored response ([`responses::asks_briefly`]:
/// not a resumed stream) whose replica the router knows: it takes no place under
/// `--max-in-flight` nor its key's. It generates nothing, and a response generated in the
/// background holds its request's places until it is final ([`background`]): its client must
/// be able to ask how it stands, and cancel it, while those places are all taken. (What
/// bounds these is the connections a client may hold, `--max-connections`, each with one at
/// a time, or HTTP/2's streams.) One about an id the router does not know takes its places:
/// finding it asks every replica.
fn brief_about_known(state: &ProxyState, method: &Method, uri: &http::Uri) -> bool {
    responses::asks_briefly(method, uri)
        && matches!(responses::target(uri.path()),
            Some(responses::Target::Stored(id)) if state.forward.owners.owner(&responses::decoded(id)).is_some())
}

/// Whether `member` (the one replica a request can go to) has room for it: a saturated one
/// is waited for ([`queue`]); one that is down for another reason is tried all the same (no
/// other has what the request needs).
fn owner_has_room(state: &ProxyState, member: &Member) -> std::future::Ready<Result<(), ProxyError>> {
    // Out of the fleet since (a removal wakes those waiting): no room will come.
    let name = &member.replica.spec.name;
    if state.fleet().member(name).is_none_or(|now| now.replica.id != member.replica.id) {
        return std::future::ready(Err(ProxyError::Unavailable(format!(
            "replica {name}, which stored the response continued, left the fleet"
        ))));
    }
    std::future::ready(match member.upstream.eligibility(state.decider.max_in_flight_per_replica()) {
        Err(upstream::Ineligible::Saturated) => Err(ProxyError::Saturated {
            reason: format!("{}: saturated (it stored the response continued)", member.replica.spec.name),
            replicas: vec![member.replica.id],
        }),
        _ => Ok(()),
    })
}

/// `GET /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`: to the replica that stored it.
/// A brief one ([`brief_about_known`]) takes no place under `--max-in-flight` nor its key's.
async fn stored_response(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    req: Request<Incoming>,
    id: &str,
    arrived: (&str, Option<access::Arrival>),
) -> Result<Response<ProxyBody>, ProxyError> {
    check_length(state, req.headers())?;
    let admitted = match brief_about_known(state, req.method(), req.uri()) {
        true => Admitted { request_id: arrived.0, slot: None, received: arrived.1 },
        false => admit(state, arrived, &queue::Line::default(), &req).await?,
    };
    // The store is the API server's: any rank's, so none is named.
    let (member, _) = find_owner(state, pool, req.headers(), id).await?;
    streamed_to(state, pool, &[member], req, admitted).await
}

/// The replica that stored response `id`, asked for with the client's credentials (or
/// `--replica-api-key`), and the
/// rank this router sent its request to, if it named one.
async fn find_owner(
    state: &ProxyState,
    pool: &Arc<Pool>,
    client: &http::HeaderMap,
    id: &str,
) -> Result<(Member, Option<u32>), ProxyError> {
    let mut headers = http::HeaderMap::new();
    let replicas = state.forward.replica_authorization.get();
    if let Some(auth) = replicas.as_ref().as_ref().or_else(|| client.get(header::AUTHORIZATION)) {
        headers.insert(header::AUTHORIZATION, auth.clone());
    }
    let (fleet, timeout) = (state.fleet(), state.forward.control_timeout);
    state.forward.owners.find(fleet, pool, id, &headers, (timeout, &state.decider.metrics)).await
}

/// A place under `--max-in-flight` for the request `req` (its id, and when it arrived), held
/// until its response ends; waiting in `line` for one if none is free ([`queue`]). Its key is
/// checked again once it has one. It holds the request's key's place too ([`per_key`]): a
/// response the router cuts (a stalled HTTP/2 stream) ends both.
async fn admit<'a>(
    state: &ProxyState,
    (request_id, received): (&'a str, Option<access::Arrival>),
    line: &queue::Line,
    req: &Request<Incoming>,
) -> Result<Admitted<'a>, ProxyError> {
    let metrics = &state.decider.metrics;
    let mut slot = match forward::Slot::try_take(&state.in_flight, &metrics.in_flight) {
        Some(slot) => slot,
        None => {
            let slot = state.queue.admit(&state.in_flight, line, metrics).await?;
            // A key revoked while it waited (by a reload, or in its key file) no longer passes.
            let authorization = req.headers().get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
            state.admission.get().key_of(req.method(), req.uri().path(), authorization)?;
            slot
        }
    };
    slot.hold_key(req.extensions().get::<per_key::KeyPlace>().and_then(per_key::KeyPlace::take));
    Ok(Admitted { request_id, slot: Some(slot), received })
}

/// What `attempt` comes to once a replica has room for it, waiting in `line` while every
/// replica it could go to is saturated ([`queue`]).
async fn with_room(
    state: &ProxyState,
    line: &queue::Line,
    mut attempt: impl FnMut() -> Result<Vec<Member>, ProxyError>,
) -> Result<Vec<Member>, ProxyError> {
    let (waiters, metrics) = (state.fleet().waiters(), &state.decider.metrics);
    let goes_to = |members: &Vec<Member>| members.first().map(|member| member.replica.id);
    state.queue.until_room(waiters, (line, metrics), || std::future::ready(attempt()), goes_to).await
}

/// What a request sent by load needs of its replica: to take it without a bootstrap room
/// (`roomless`; an SGLang decode replica refuses such a completion or chat, [`disagg`]), to
/// serve SGLang's `/generate` (`generate`: vLLM's replicas do not).
#[derive(Clone, Copy)]
struct Takes {
    roomless: bool,
    generate: bool,
}

impl Takes {
    /// Any replica that decodes.
    const ANY: Takes = Takes { roomless: false, generate: false };
}

/// Any other request that passes through ([`paths::passes_through`]): streamed to the
/// least-loaded eligible replica.
async fn passthrough(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    req: Request<Incoming>,
    arrived: (&str, Option<access::Arrival>),
) -> Result<Response<ProxyBody>, ProxyError> {
    // Refused before it waits for room: the room it took would go unused.
    check_length(state, req.headers())?;
    let line = queue::Line::default();
    let admitted = admit(state, arrived, &line, &req).await?;
    // The next ones are tried while no connection to one can be made.
    let members = with_room(state, &line, || by_load(state, arrived.0, None, Takes::ANY)).await?;
    streamed_to(state, pool, &members, req, admitted).await
}

/// The eligible replicas, the least loaded first: the fewest requests (this router's and
/// others'), ties spread by the request's id (the first of equals would send every lone
/// request to the lowest id). None is a 503: [`ProxyError::Saturated`] if one of them could
/// take the request once it has room.
fn by_load(
    state: &ProxyState,
    request_id: &str,
    adapter: Option<upstream::Adapter<'_>>,
    Takes { roomless, generate }: Takes,
) -> Result<Vec<Member>, ProxyError> {
    let mut members = state.fleet().members();
    // A prefill replica takes prefills only ([`disagg`]).
    let listed = members.len();
    members.retain(|member| route::Hop::Whole.takes(member));
    if members.is_empty() && listed > 0 {
        return Err(ProxyError::Unavailable(disagg::NO_DECODER.into()));
    }
    if roomless {
        let decoders = members.len();
        members.retain(|member| route::Hop::Roomless.takes(member));
        if members.is_empty() && decoders > 0 {
            return Err(ProxyError::Unavailable(disagg::NO_ROOMLESS.into()));
        }
    }
    if generate {
        members.retain(|member| member.replica.spec.serves_generate());
        if members.is_empty() {
            return Err(ProxyError::Unavailable(route::NO_GENERATE.into()));
        }
    }
    let max = state.decider.max_in_flight_per_replica();
    let verdicts = upstream::verdicts_for(members.iter().map(|m| &*m.upstream), max, adapter);
    if verdicts.iter().all(Option::is_some) {
        let saturated =
            members.iter().zip(&verdicts).filter(|(_, v)| **v == Some(upstream::Ineligible::Saturated));
        let replicas: Vec<_> = saturated.map(|(m, _)| m.replica.id).collect();
        return Err(match replicas.is_empty() {
            true => ProxyError::Unavailable("no healthy replica".into()),
            false => ProxyError::Saturated { reason: "every replica is saturated".into(), replicas },
        });
    }
    let mut eligible: Vec<_> = members
        .into_iter()
        .zip(verdicts)
        .filter_map(|(m, verdict)| verdict.is_none().then_some(m))
        .map(|m| {
            let load = m.upstream.load();
            let tie = crate::policy::rendezvous(xxh3_64(request_id.as_bytes()), m.replica.tie);
            ((load.in_flight.saturating_add(load.others), std::cmp::Reverse(tie)), m)
        })
        .collect();
    eligible.sort_unstable_by_key(|(key, _)| *key);
    Ok(eligible.into_iter().map(|(_, m)| m).collect())
}

/// A body whose `Content-Length` is past `--max-body-bytes` is refused before the request
/// takes a place or room (a body that says nothing of its length is cut off at the limit as
/// it is read or streamed: [`read_body`], [`streamed_to`]).
fn check_length(state: &ProxyState, headers: &http::HeaderMap) -> Result<(), ProxyError> {
    match content_length(headers).is_some_and(|n| n > state.forward.max_body_bytes) {
        true => Err(ProxyError::BodyTooLarge { limit: state.forward.max_body_bytes }),
        false => Ok(()),
    }
}

/// Sends `req` to the first of `members` that takes a connection, its body streamed through
/// (its stated length checked already: [`check_length`]).
async fn streamed_to(
    state: &Arc<ProxyState>,
    pool: &Arc<Pool>,
    members: &[Member],
    req: Request<Incoming>,
    admitted: Admitted<'_>,
) -> Result<Response<ProxyBody>, ProxyError> {
    let (parts, body) = req.into_parts();
    let uploaded = upload::Progress::default();
    let body =
        upload::Upload::new(Limited::new(body, state.forward.max_body_bytes), state.forward.idle_timeout)
            .tracking(uploaded.clone())
            .boxed_unsync();
    let sending = Sending::streamed(body, uploaded);
    forward::to_replica(pool, &state.forward, &state.decider, members, parts, sending, admitted).await
}

fn content_length(headers: &http::HeaderMap) -> Option<usize> {
    headers.get(header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// Reads a whole request body, refusing more than `limit` bytes and a body that stalls for
/// `idle` (it holds an in-flight slot while it is read; its stated length is checked before
/// it takes that: [`check_length`]).
async fn read_body(body: Incoming, limit: usize, idle: Duration) -> Result<Bytes, ProxyError> {
    match upload::Upload::new(Limited::new(body, limit), idle).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => Err(upload::client_error(&e, limit)),
    }
}

/// The fleet's models: the served model, with the fields a healthy replica lists for it
/// (vLLM's `max_model_len`, `root`, `owned_by`: clients size their context by the first),
/// and the LoRA adapters the router knows (configured, loaded through it, or listed by a
/// replica).
fn models(state: &ProxyState) -> serde_json::Value {
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let base = state.base_model.as_str();
    let listed = served_card(state);
    let owned_by =
        listed.as_ref().and_then(|card| card.get("owned_by").cloned()).unwrap_or_else(|| "kvroute".into());
    let card = |id: &str, parent: Option<&str>| {
        serde_json::json!({
            "id": id, "object": "model", "created": created, "owned_by": owned_by, "root": base, "parent": parent,
        })
    };
    let mut served = card(base, None);
    if let (Some(listed), Some(fields)) = (&listed, served.as_object_mut()) {
        for (name, value) in listed.iter().filter(|(name, _)| !["object", "created"].contains(&name.as_str()))
        {
            fields.insert(name.clone(), value.clone());
        }
    }
    let adapters = state.decider.prompts.tokenization().lora_adapters();
    let data: Vec<serde_json::Value> =
        std::iter::once(served).chain(adapters.iter().map(|a| card(a, Some(base)))).collect();
    serde_json::json!({"object": "list", "data": data})
}

/// The served model's card as the replicas list it: a healthy replica's first; with none
/// healthy (a fleet late to its checks is still served), any replica's.
pub(crate) fn served_card(state: &ProxyState) -> Option<Arc<serde_json::Map<String, serde_json::Value>>> {
    let members = state.fleet().members();
    members.iter().filter(|m| m.upstream.is_healthy()).chain(&members).find_map(|m| m.upstream.card())
}

fn metrics(state: &ProxyState) -> Response<ProxyBody> {
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, &state.registry) {
        tracing::error!(error = %e, "encoding metrics");
    }
    let mut r = Response::new(full(Bytes::from(text)));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    r
}

fn json(status: StatusCode, value: serde_json::Value) -> Response<ProxyBody> {
    let mut r = Response::new(full(Bytes::from(value.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

/// Whether the router answers a path itself, whatever the answer ([`cors`]).
fn answers_itself(path: &str) -> bool {
    path == "/v1/models" || is_probe(path) || lora::route(path).is_some()
}

/// A transfer coding other than `chunked` in the request's `Transfer-Encoding`, if any.
fn foreign_transfer_coding(headers: &http::HeaderMap) -> Option<String> {
    let codings = headers
        .get_all(header::TRANSFER_ENCODING)
        .into_iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','));
    codings
        .map(|c| c.trim_ascii())
        .find(|c| !c.is_empty() && !c.eq_ignore_ascii_case(b"chunked"))
        .map(|c| String::from_utf8_lossy(c).into_owned())
}

/// The router's own probes and scrapes.
fn is_probe(path: &str) -> bool {
    matches!(path, "/health" | "/ready" | "/metrics")
}

/// Whether an HTTP/1.1 request asks to become a WebSocket (RFC 6455 §4.1: `Upgrade:
/// websocket`, named in `Connection`); other upgrades (curl's `h2c`) are optional for a
/// server, which answers over HTTP/1.1 instead.
fn asks_websocket(headers: &http::HeaderMap) -> bool {
    let connection_upgrade =
        http1::connection_options(headers).any(|option| option.eq_ignore_ascii_case(b"upgrade"));
    connection_upgrade && tunnel::names_websocket(headers)
}

/// The client's `x-request-id` if it sent a sane one, else a fresh one.
fn request_id(req: &Request<Incoming>) -> String {
    req.headers()
        .get(forward::X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(fresh_request_id, str::to_owned)
}

/// `kvr-` and a [`fresh_id`] in 16 hex digits.
fn fresh_request_id() -> String {
    let mut id = *b"kvr-0123456789abcdef";
    // Cannot fail: 8 bytes take 16 hex digits.
    let _ = hex::encode_to_slice(fresh_id().to_be_bytes(), &mut id[4..]);
    String::from_utf8_lossy(&id).into_owned()
}

/// A request id nobody will guess or repeat: splitmix64 over a counter from a random start,
/// one per thread (the thread's random generator cost more than the rest of the id).
fn fresh_id() -> u64 {
    thread_local! {
        static STATE: std::cell::Cell<u64> = std::cell::Cell::new(rand::random());
    }
    STATE.with(|state| {
        let mut ids = kvroute_proto::mix::SplitMix64(state.get());
        let id = ids.next_u64();
        state.set(ids.0);
        id
    })
}

#[cfg(test)]
mod tests {
    /// Ids drawn on two threads: none repeats (each thread's stream starts at random).
    #[test]
    fn fresh_ids_do_not_repeat_across_threads() {
        let draw = || std::thread::spawn(|| (0..1000).map(|_| super::fresh_id()).collect::<Vec<u64>>());
        let (a, b) = (draw(), draw());
        let mut ids: Vec<u64> = a.join().unwrap().into_iter().chain(b.join().unwrap()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), 2000);
    }
}
