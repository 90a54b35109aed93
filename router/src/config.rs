//! The router's configuration: one [`Config`] from flags, `KVROUTE_*` environment variables
//! and an optional TOML file (`--config`; keys spelled like the flags), in that order of
//! precedence. [`Config::validate`] reports every problem at once, before anything starts.
//!
//! Replicas are listed statically, as repeated `--replica` flags
//! (`name=r0,http=http://10.0.0.7:8000,events=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558,grpc=http://10.0.0.7:50051,engine=kvroute`)
//! or as `[[replica]]` tables in the file, or added at run time through the admin API.

use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use clap::Parser;
use http::HeaderValue;
use serde::{Deserialize, Serialize};

use crate::discovery::DiscoveryConfig;
use kvroute_proto::serve::{ClientFiles, Limits, MIN_HEADER_BYTES, Tls, TlsFiles};
use tokio_rustls::rustls::pki_types::ServerName;

use crate::policy::{CacheAwareParams, MAX_WEIGHT, PolicyKind};
use crate::proxy::connect::ReplicaTls;
use crate::proxy::key_file::KeyFile;
use crate::proxy::replica_key::ReplicaKeyFile;
use crate::proxy::route::RequestLimits;
use crate::replicas::{EngineKind, ReplicaSpec, Role, base_url};

/// Most proxy threads `--http-threads` accepts.
pub const MAX_HTTP_THREADS: usize = 1024;

/// Most requests `--max-queued` lets wait at once.
pub const MAX_QUEUED: usize = 1 << 20;

/// Longest wait `--queue-timeout-ms` allows: an hour.
pub const MAX_QUEUE_TIMEOUT_MS: u64 = 3_600_000;

/// Past `--drain-timeout-ms`, how long the streams it ended have to send their error events
/// before the connections still open are closed.
pub const DRAIN_END: Duration = Duration::from_secs(1);

/// kvroute: a cache-aware reverse proxy for OpenAI-compatible inference fleets.
#[derive(Parser, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[command(name = "kvroute-router", version, about, long_about = None)]
#[serde(rename_all = "kebab-case")]
pub struct Config {
    /// TOML file with any of these settings (keys spelled like the flags).
    #[arg(long, env = "KVROUTE_CONFIG")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<PathBuf>,

    /// Address of the OpenAI-compatible proxy.
    #[arg(long, env = "KVROUTE_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// Address of the gRPC admin service (loopback by default).
    #[arg(long, env = "KVROUTE_ADMIN_LISTEN", default_value = "127.0.0.1:50061")]
    pub admin_listen: SocketAddr,
    /// Log every request (client address, model, replica, predicted and reported cached
    /// tokens, status, timings) at INFO under the target `kvroute_router::access`.
    #[arg(long, env = "KVROUTE_ACCESS_LOG", default_value_t = false)]
    pub access_log: bool,
    /// Tell the replicas who the client is: the client's address is appended to
    /// `X-Forwarded-For` (as nginx's `$proxy_add_x_forwarded_for`), and `X-Forwarded-Proto`
    /// to the scheme the client used (`http`, or `https` with `--tls-cert`). For replicas' logs (uvicorn reads them from
    /// proxies its `--forwarded-allow-ips` trusts).
    #[arg(long, env = "KVROUTE_FORWARDED_FOR", default_value_t = false)]
    pub forwarded_for: bool,
    /// Origins whose pages may read the router's own answers (its errors, `/v1/models`),
    /// comma-separated, as vLLM's `--allowed-origins`: `*` (the default) is any origin, an
    /// empty value none. The replicas' answers carry the replicas' own CORS fields.
    #[arg(long, env = "KVROUTE_ALLOWED_ORIGINS", value_delimiter = ',', default_value = "*")]
    #[serde(default = "any_origin")]
    pub allowed_origins: Vec<String>,
    /// Address of a listener of its own for `GET /health`, `/ready` and `/metrics`, outside
    /// the proxy's connection limit, so that a liveness probe is answered while the proxy is
    /// full; plain HTTP when the proxy serves TLS.
    #[arg(long, env = "KVROUTE_HEALTH_LISTEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub health_listen: Option<SocketAddr>,
    /// Keys a request to a path under `/v1` (or to SGLang's `/generate`) must carry one of
    /// (`Authorization: Bearer <key>`), comma-separated, as with vLLM's `--api-key`: others get
    /// 401 (the router's LoRA fan-out too, SGLang's spellings outside `/v1` included). Other
    /// paths outside `/v1` stay open, as with vLLM (`/health`, `/ready`, `/metrics`, and the
    /// engines' own paths passed through, such as `/tokenize`). The header goes on to the replica as it came.
    #[arg(long, env = "KVROUTE_API_KEY", hide_env_values = true, value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty", deserialize_with = "comma_separated")]
    pub api_key: Vec<Secret>,
    /// A file of keys as `--api-key`'s (separated by commas, blanks or lines; a word that
    /// begins with `#` begins a comment, to the end of its line), which pass with them: read
    /// again at each `SIGHUP` and whenever it changes (`--api-key-check-ms`), so keys rotate
    /// without a restart (a Kubernetes Secret mounted as a volume). A file that cannot be read
    /// or holds no key stops the start; later, it keeps the keys in use (an emptied file never
    /// opens the API).
    #[arg(long, env = "KVROUTE_API_KEY_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<PathBuf>,
    /// How often `--api-key-file` and `--replica-api-key-file` are checked for a change,
    /// milliseconds. 0: only at a `SIGHUP`.
    #[arg(long, env = "KVROUTE_API_KEY_CHECK_MS", default_value_t = 10_000)]
    pub api_key_check_ms: u64,
    /// The key of replicas started with their own `--api-key` (vLLM's, SGLang's): a request to
    /// a path the router's keys guard (`/v1/*`, the LoRA paths) reaches them with it
    /// (`Authorization: Bearer <key>`) in place of the client's, as do the router's own (health
    /// checks' adapter listings, remote tokenization, the LoRA catch-up). Clients' keys
    /// (`--api-key`) then stay the router's, and rotate without the replicas. The engines' own
    /// paths outside `/v1` keep the client's `Authorization`, as does every request without
    /// this key. A reload changes it at once (replicas that take both keys for a while rotate
    /// it without a restart of the router).
    #[arg(long, env = "KVROUTE_REPLICA_API_KEY", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_api_key: Option<Secret>,
    /// `--replica-api-key` from a file that holds it (a mounted Secret): read again at each
    /// `SIGHUP` and when it changes (checked every `--api-key-check-ms`), so the key rotates
    /// without a restart of the router. One or the other.
    #[arg(long, env = "KVROUTE_REPLICA_API_KEY_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_api_key_file: Option<PathBuf>,
    /// PEM certificates of the authorities `https://` replicas' certificates must chain to (the
    /// system's without it). A replica's certificate must also name the host of its URL (or
    /// `--replica-tls-server-name`). This
    /// file and the client certificate's are read again at each `SIGHUP` and when they change
    /// (`--tls-check-ms`), for the connections opened from then on.
    #[arg(long, env = "KVROUTE_REPLICA_CA_CERT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_ca_cert: Option<PathBuf>,
    /// The name every `https://` replica's certificate must hold (and that is sent as SNI), in
    /// place of the host of its URL: for replicas reached by IP address (as discovery finds
    /// them) whose certificates name their service (`vllm.default.svc`, say).
    #[arg(long, env = "KVROUTE_REPLICA_TLS_SERVER_NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_tls_server_name: Option<String>,
    /// PEM certificate chain the router shows `https://` replicas that ask for one (mutual TLS:
    /// vLLM's `--ssl-ca-certs` with `--ssl-cert-reqs 2`). With `--replica-client-key`.
    #[arg(long, env = "KVROUTE_REPLICA_CLIENT_CERT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_client_cert: Option<PathBuf>,
    /// PEM private key of `--replica-client-cert`.
    #[arg(long, env = "KVROUTE_REPLICA_CLIENT_KEY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replica_client_key: Option<PathBuf>,
    /// PEM certificate chain (the router's own first) the proxy's listener serves TLS with:
    /// HTTPS, HTTP/2 or HTTP/1.1 by ALPN. With `--tls-key`. Both files (and
    /// `--tls-client-ca`'s) are read again when they change (`--tls-check-ms`) and at each
    /// `SIGHUP`, so a certificate rotated in place (cert-manager, a mounted Secret) is served
    /// to the connections opened from then on. The health listener stays plain; the admin
    /// service too, unless `--admin-tls`.
    #[arg(long, env = "KVROUTE_TLS_CERT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `--tls-cert`.
    #[arg(long, env = "KVROUTE_TLS_KEY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// PEM certificates of the authorities clients' certificates must chain to (mutual TLS,
    /// with `--tls-cert`): a client without such a certificate does not get through the
    /// handshake. Read again as `--tls-cert` is; a reload that no longer names it (while TLS
    /// stays on) admits clients without a certificate from then on. The health listener stays
    /// plain.
    #[arg(long, env = "KVROUTE_TLS_CLIENT_CA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<PathBuf>,
    /// How often the `--tls-cert`, `--tls-key` and `--tls-client-ca` files (and the
    /// `--replica-*` TLS files) are checked for a change (a certificate renewed in place, a
    /// Secret updated in its volume), milliseconds; a change is used by new connections. 0: only
    /// at a `SIGHUP`.
    #[arg(long, env = "KVROUTE_TLS_CHECK_MS", default_value_t = 10_000)]
    pub tls_check_ms: u64,
    /// Bearer token the admin service requires; mandatory when it listens beyond loopback.
    #[arg(long, env = "KVROUTE_ADMIN_TOKEN", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token: Option<Secret>,
    /// The admin service serves TLS (HTTP/2 by ALPN) with the proxy's `--tls-cert` and
    /// `--tls-key`, renewed in place as theirs are; with `--tls-client-ca`, only to clients
    /// with a certificate of those authorities. Beyond loopback its token then does not
    /// cross the network in the clear.
    #[arg(long, env = "KVROUTE_ADMIN_TLS", default_value_t = false)]
    #[serde(default)]
    pub admin_tls: bool,

    /// A replica: `name=..,http=..[,events=..][,replay=..][,grpc=..][,engine=kvroute|vllm|sglang][,dp-size=N][,topic=..]`
    /// `[,role=both|prefill|decode][,bootstrap-port=N]` (prefill/decode disaggregation: see the
    /// README).
    /// Without `events`, its cache is predicted from this router's requests to it
    /// (`--predicted-ttl-ms`, `--predicted-cache-tokens`).
    #[arg(id = "replica", long = "replica", env = "KVROUTE_REPLICAS", value_delimiter = ';')]
    #[serde(default, rename = "replica")]
    pub replicas: Vec<ReplicaConfig>,

    /// Routing policy.
    #[arg(long, env = "KVROUTE_POLICY", value_enum, default_value_t = PolicyKind::CacheAware)]
    pub policy: PolicyKind,
    /// Cache-aware cost: weight of a replica's in-flight requests, in prefill-token units.
    #[arg(long, env = "KVROUTE_LOAD_WEIGHT", default_value_t = CacheAwareParams::default().in_flight_tokens)]
    pub load_weight: f64,
    /// Cache-aware cost: weight of an uncached prompt token relative to a queued one.
    #[arg(long, env = "KVROUTE_MISS_WEIGHT", default_value_t = CacheAwareParams::default().miss_weight)]
    pub miss_weight: f64,
    /// Cache-aware cost: charge, in units of the request's prompt tokens, per multiple of the
    /// fleet's mean recent prompt tokens that a replica has above that mean (0 turns it off).
    #[arg(long, env = "KVROUTE_BALANCE_WEIGHT", default_value_t = CacheAwareParams::default().balance_weight)]
    pub balance_weight: f64,
    /// Cache-aware cost: weight of a prompt token a replica loads from host memory (a vLLM
    /// or SGLang cache offloaded to CPU) relative to an uncached one.
    #[arg(long, env = "KVROUTE_OFFLOAD_WEIGHT", default_value_t = CacheAwareParams::default().offload_weight)]
    pub offload_weight: f64,
    /// How long a routing decision credits the chosen replica with the request's blocks
    /// after the replica's first output for it (before that, however long the request
    /// queues, they hold), unless its events confirm them first, milliseconds. A replica
    /// seen restarted, or unreachable for the fallback time, loses its credits at once.
    #[arg(long, env = "KVROUTE_CREDIT_TTL_MS", default_value_t = 2_000)]
    pub credit_ttl_ms: u64,
    /// Seed of the random and power-of-two policies; drawn at start (and logged) when not
    /// given, so that several routers in front of one fleet do not draw in lockstep.
    #[arg(long, env = "KVROUTE_SEED")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,

    /// Served model name: the cache namespace's model (must match the replicas').
    #[arg(long, env = "KVROUTE_MODEL", default_value = "kvroute-sim")]
    pub model: String,
    /// LoRA adapter names the fleet serves (comma-separated). The router also learns those the
    /// vLLM and kvroute replicas list, and sends an adapter's requests only to the replicas
    /// whose list has it (a replica that lists nothing, SGLang's say, may be sent any).
    #[arg(long, env = "KVROUTE_LORA_ADAPTERS", value_delimiter = ',')]
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// Let clients load and unload LoRA adapters through the router (sent to every replica;
    /// vLLM needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`). Any client of the router can
    /// then change every replica.
    #[arg(long, env = "KVROUTE_LORA_UPDATES", default_value_t = false)]
    pub lora_updates: bool,
    /// Tokens per KV block on the replicas.
    #[arg(long, env = "KVROUTE_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// The vLLM replicas run EAGLE, EAGLE-3 or MTP speculative decoding: vLLM then computes
    /// the last block of a cache hit again (for the draft head), so a prompt reuses one block
    /// fewer than it holds.
    #[arg(long, env = "KVROUTE_EAGLE", default_value_t = false)]
    pub eagle: bool,
    /// Leave a data-parallel replica's rank to the replica's own balancing, and score the
    /// replica on the union of its ranks: for engines that ignore `X-data-parallel-rank`
    /// (vLLM before 0.14, SGLang before 0.5.10). By default the cache-aware policy names the
    /// rank that holds the prefix.
    #[arg(long, env = "KVROUTE_NO_RANK_ROUTING", default_value_t = false)]
    #[serde(default)]
    pub no_rank_routing: bool,
    /// With replicas of role `prefill` or `decode`: a request's prefill goes to a prefill
    /// replica first when the decode replica chosen lacks at least this many of its prompt
    /// tokens; shorter ones are prefilled where they are decoded.
    #[arg(long, env = "KVROUTE_PD_MIN_PREFILL_TOKENS", default_value_t = 512)]
    pub pd_min_prefill_tokens: u64,
    /// HuggingFace tokenizer.json of the model, or the model's directory holding it; the
    /// built-in tokenizer when absent. A tokenizer_config.json beside it is read unless
    /// --tokenizer-config names one, as vLLM reads the model's directory.
    #[arg(long, env = "KVROUTE_TOKENIZER")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// tokenizer_config.json (for its special tokens and the model's chat template, which a
    /// chat_template.jinja beside it overrides, as transformers loads it); by default the one
    /// beside the tokenizer.json.
    #[arg(long, env = "KVROUTE_TOKENIZER_CONFIG")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer_config: Option<PathBuf>,
    /// Jinja chat template file, overriding the tokenizer config's: the replicas'
    /// `--chat-template`, when they have one (a trusted request's kwargs template is then
    /// not used, as vLLM does not use it).
    #[arg(long, env = "KVROUTE_CHAT_TEMPLATE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
    /// The fleet's vLLM flags that change how chats are rendered (the router's must be the
    /// replicas'; router and agents read the same environment variables).
    #[command(flatten)]
    #[serde(flatten)]
    pub chat: kvroute_proto::openai::ChatOptions,
    /// Ask a replica's `/tokenize` instead of tokenizing locally (results are cached). The
    /// healthy replicas take turns by prompt; one that fails is followed by the next.
    #[arg(long, env = "KVROUTE_REMOTE_TOKENIZE", default_value_t = false)]
    pub remote_tokenize: bool,
    /// Time allowed for one replica's `/tokenize` answer, milliseconds.
    #[arg(long, env = "KVROUTE_TOKENIZE_TIMEOUT_MS", default_value_t = 10_000)]
    pub tokenize_timeout_ms: u64,
    /// Bytes of token ids kept for prompts' beginnings, so that a prompt beginning like an
    /// earlier one (a chat's next turn) is tokenized only from where it differs; 0 turns it
    /// off. The ids are the same either way.
    #[arg(long, env = "KVROUTE_TOKENIZE_CACHE_BYTES", default_value_t = 64 << 20)]
    pub tokenize_cache_bytes: u64,

    /// Responses API ids whose replica the router remembers (about 100 bytes each): a later
    /// request about one (`previous_response_id`, `GET /v1/responses/{id}`) goes to the replica
    /// that stored it. An id it has let go, or one over 256 bytes (no engine makes those), is
    /// asked of every replica again.
    #[arg(long, env = "KVROUTE_RESPONSE_OWNERS", default_value_t = 100_000)]
    pub response_owners: usize,

    /// A replica's event stream without a connection this long is FALLBACK (scored as holding
    /// what every replica with a stream holds, and on its load), milliseconds; also the event
    /// socket's connect timeout.
    #[arg(long, env = "KVROUTE_EVENTS_FALLBACK_MS", default_value_t = 10_000)]
    pub events_fallback_ms: u64,
    /// Timeout of a replay's connect and of each of its replies, milliseconds (a large cache
    /// over a slow network may need more).
    #[arg(long, env = "KVROUTE_REPLAY_TIMEOUT_MS", default_value_t = 5_000)]
    pub replay_timeout_ms: u64,
    /// Timeout of a whole snapshot of a replica's cache over gRPC, milliseconds.
    #[arg(long, env = "KVROUTE_SNAPSHOT_TIMEOUT_MS", default_value_t = 30_000)]
    pub snapshot_timeout_ms: u64,
    /// A replica without events (no `events=`) is predicted to hold the prompts this router
    /// sent it: each block until this long after the last request that used it,
    /// milliseconds (it stands for what the router does not see evict it: other clients'
    /// requests, generated tokens).
    #[arg(long, env = "KVROUTE_PREDICTED_TTL_MS", default_value_t = 120_000)]
    pub predicted_ttl_ms: u64,
    /// A replica without events is predicted to hold at most this many tokens, the least
    /// recently sent leaving first, unless its metrics page says its KV cache's size (vLLM's
    /// `vllm:cache_config_info`, SGLang's `sglang:max_total_num_tokens`), which wins.
    #[arg(long, env = "KVROUTE_PREDICTED_CACHE_TOKENS", default_value_t = 1 << 20)]
    pub predicted_cache_tokens: usize,

    /// Upstream connect timeout (the TLS handshake included), milliseconds; less than
    /// `--first-byte-timeout-ms`, which counts from the send, connecting included. A replica
    /// that cannot be reached in time is tried no further and the next one is.
    #[arg(long, env = "KVROUTE_CONNECT_TIMEOUT_MS", default_value_t = 1_000)]
    pub connect_timeout_ms: u64,
    /// Time allowed until an upstream's response headers arrive, milliseconds. A replica that
    /// times out is tried no further for the request (504) and counts toward its ejection.
    /// vLLM and SGLang answer a non-streamed request only once it is generated: set this above
    /// the longest generation a non-streamed request may ask for (10 minutes by default, the
    /// OpenAI SDK's own timeout: the router does not give up on a long answer before its
    /// client would). For a streamed upload it counts from the upload's end (meanwhile, from
    /// when the replica last took some of it, and not while the upload waits for the client).
    #[arg(long, env = "KVROUTE_FIRST_BYTE_TIMEOUT_MS", default_value_t = 600_000)]
    pub first_byte_timeout_ms: u64,
    /// How long a prefill replica may take to answer a prefill sent ahead of its request
    /// (one token, no stream), milliseconds; past it, the decode replica prefills the prompt
    /// itself (an SGLang one cannot: the request fails with a 504; SGLang's prefill replica
    /// answers once its decode replica took the KV, so this covers the decode's wait too).
    #[arg(long, env = "KVROUTE_PD_PREFILL_TIMEOUT_MS", default_value_t = 60_000)]
    pub pd_prefill_timeout_ms: u64,
    /// After SIGTERM, how long open requests may go on, milliseconds: then open streams end
    /// with an error event and, a second later, the connections still open are closed and
    /// the router exits. Under a Kubernetes grace period (the manifests' allow for its
    /// default), so that a stream still running gets its error event rather than a SIGKILL.
    /// 0 ends them at once.
    #[arg(long, env = "KVROUTE_DRAIN_TIMEOUT_MS", default_value_t = 590_000)]
    pub drain_timeout_ms: u64,
    /// Time allowed for a replica's answer that is not a generation's, milliseconds: a LoRA
    /// adapter change (a load may download the adapter; SGLang's unload waits for the
    /// adapter's requests), a catch-up load, a lookup of a stored response, a WebSocket
    /// handshake. A replica that hangs holds these (the LoRA changes' turn among them) no
    /// longer.
    #[arg(long, env = "KVROUTE_CONTROL_TIMEOUT_MS", default_value_t = 120_000)]
    pub control_timeout_ms: u64,
    /// Longest silence allowed inside a streaming response, and inside a request's body
    /// (then 408), milliseconds. A stream's first event may take until the first-byte
    /// timeout (counted from the request's sending) if that is longer: vLLM sends a stream's
    /// headers at once, its first event after the request's queueing and prefill. A
    /// WebSocket tunnel is closed after this long with nothing sent either way.
    #[arg(long, env = "KVROUTE_IDLE_TIMEOUT_MS", default_value_t = 60_000)]
    pub idle_timeout_ms: u64,
    /// Longest a client may take nothing of its response, milliseconds: an HTTP/1 connection
    /// whose write waits this long is closed, an HTTP/2 response whose stream has had no
    /// window for this long is cut; either way the replica's request ends and its load is
    /// released.
    #[arg(long, env = "KVROUTE_SEND_TIMEOUT_MS", default_value_t = 60_000)]
    pub send_timeout_ms: u64,
    /// Largest accepted request body, bytes (32 MiB: a chat with several base64 images, an
    /// audio file at vLLM's 25 MB limit).
    #[arg(long, env = "KVROUTE_MAX_BODY_BYTES", default_value_t = 32 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Requests in flight through the router before new ones wait in line for a place
    /// (`--queue-timeout-ms`), then get 503 (a request counts until its response ends, streams
    /// included, a WebSocket tunnel until it closes, and a Responses request generated in the
    /// background until its replica shows the response final; a brief ask about a stored
    /// response the router knows counts not at all).
    #[arg(long, env = "KVROUTE_MAX_IN_FLIGHT", default_value_t = 4_096)]
    pub max_in_flight: usize,
    /// Threads serving the proxy's HTTP connections, each with its own accept loop and
    /// upstream connection pool; 0 means one per CPU core.
    #[arg(long, env = "KVROUTE_HTTP_THREADS", default_value_t = 0)]
    pub http_threads: usize,
    /// Client connections open at once; more wait in the listen backlog.
    #[arg(long, env = "KVROUTE_MAX_CONNECTIONS", default_value_t = Limits::default().max_connections)]
    pub max_connections: usize,
    /// Largest request head (request line and headers), bytes; larger ones get 431.
    #[arg(long, env = "KVROUTE_MAX_HEADER_BYTES", default_value_t = Limits::default().max_header_bytes)]
    pub max_header_bytes: usize,
    /// Most prompt tokens (all prompts of a request together) routed; more get 400. The
    /// default leaves room for million-token contexts (the replicas refuse what is past
    /// theirs): set the model's context length to refuse longer prompts before they are sent.
    #[arg(long, env = "KVROUTE_MAX_PROMPT_TOKENS", default_value_t = 1 << 20)]
    pub max_prompt_tokens: u64,
    /// Largest `max_tokens` / `max_completion_tokens` a request may ask for; more get 400.
    #[arg(long, env = "KVROUTE_MAX_COMPLETION_TOKENS", default_value_t = 1 << 20)]
    pub max_completion_tokens: u64,
    /// Requests each client key (`--api-key`, `--api-key-file`) may have in flight through this
    /// router at once; past it, 429 at once (`rate_limit_exceeded`, `Retry-After: 1`), so that
    /// no tenant takes every place from the others. 0: no limit. Each router counts its own.
    #[arg(long, env = "KVROUTE_MAX_IN_FLIGHT_PER_KEY", default_value_t = 0)]
    pub max_in_flight_per_key: u32,
    /// Requests in flight on one replica before it counts as saturated. Requests routed on
    /// their prompt take a place as they are decided, never past it; others (a stored
    /// response's continuation, a prompt of embeddings, requests that pass through, WebSocket
    /// sessions) may pass it by up to `--http-threads` - 1, decided at the same moment on
    /// different threads.
    #[arg(long, env = "KVROUTE_MAX_IN_FLIGHT_PER_REPLICA", default_value_t = 512)]
    pub max_in_flight_per_replica: u32,
    /// Requests that may wait for room at once: at `--max-in-flight`, or with every replica
    /// it could go to at `--max-in-flight-per-replica`, a request waits up to
    /// `--queue-timeout-ms` instead of getting 503 at once; past this many waiting, it gets
    /// 503 at once.
    #[arg(long, env = "KVROUTE_MAX_QUEUED", default_value_t = 1_024)]
    pub max_queued: usize,
    /// Longest a request waits for room before it gets 503, milliseconds; 0 turns waiting
    /// off (503 at once, as with `--max-queued 0`).
    #[arg(long, env = "KVROUTE_QUEUE_TIMEOUT_MS", default_value_t = 5_000)]
    pub queue_timeout_ms: u64,
    /// Interval of active health checks (`GET /health`), milliseconds.
    #[arg(long, env = "KVROUTE_HEALTH_INTERVAL_MS", default_value_t = 2_000)]
    pub health_interval_ms: u64,
    /// Time allowed for a health check's answer (and for each read of the replica's
    /// `/metrics` and `/v1/models` that follows a check passed), milliseconds. SGLang's
    /// `/health` runs a one-token generation and takes about a second. Each replica's check
    /// runs on its own: a slow one holds up no other's, and is not checked again until it
    /// is over.
    #[arg(long, env = "KVROUTE_HEALTH_TIMEOUT_MS", default_value_t = 2_000)]
    pub health_timeout_ms: u64,
    /// Consecutive failed health checks (no 2xx within --health-timeout-ms) that make a
    /// replica unhealthy; one check passed makes it healthy again. One slow answer under load
    /// takes no replica out; and while no replica is up, those whose checks only went
    /// unanswered in time (busy, not refusing) are still tried, so a fleet slow all at once
    /// keeps serving.
    #[arg(long, env = "KVROUTE_UNHEALTHY_AFTER", default_value_t = 3)]
    pub unhealthy_after: u32,
    /// Consecutive failures that eject a replica: connection refused or reset before an
    /// answer, the first-byte timeout, a 5xx other than 503, a response body broken off or
    /// silent past --idle-timeout-ms.
    #[arg(long, env = "KVROUTE_EJECT_AFTER", default_value_t = 3)]
    pub eject_after: u32,
    /// How long an ejected replica is kept out before it is tried again, milliseconds (unless
    /// every replica that is up is ejected: then they are all tried).
    #[arg(long, env = "KVROUTE_EJECTION_MS", default_value_t = 10_000)]
    pub ejection_ms: u64,

    /// Replica discovery (DNS or Kubernetes EndpointSlices) besides the static list.
    #[command(flatten)]
    #[serde(flatten)]
    pub discovery: DiscoveryConfig,
}

impl kvroute_proto::cli::Layered for Config {
    fn config_file(&self) -> Option<&Path> {
        self.config.as_deref()
    }
}

fn any_origin() -> Vec<String> {
    vec!["*".into()]
}

impl Default for Config {
    fn default() -> Self {
        kvroute_proto::cli::defaults()
    }
}

/// `Authorization: Bearer <key>`, marked sensitive (kept out of logs and of HTTP/2's header
/// compression tables); `None` if `key` is empty, holds whitespace or cannot be a header.
pub fn bearer(key: &str) -> Option<HeaderValue> {
    if key.is_empty() || key.contains(char::is_whitespace) {
        return None;
    }
    let mut value = HeaderValue::from_str(&format!("Bearer {key}")).ok()?;
    value.set_sensitive(true);
    Some(value)
}

impl Config {
    /// The cache-aware cost's weights.
    pub fn cache_aware_params(&self) -> CacheAwareParams {
        CacheAwareParams {
            in_flight_tokens: self.load_weight,
            miss_weight: self.miss_weight,
            balance_weight: self.balance_weight,
            offload_weight: self.offload_weight,
        }
    }

    /// A config for tests and embedded fleets: proxy and admin on 127.0.0.1 port 0.
    pub fn loopback(replicas: Vec<ReplicaConfig>) -> Self {
        let any: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        Config { listen: any, admin_listen: any, replicas, ..Config::default() }
    }

    /// Every problem with the settings, or `Ok`.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        self.problems(true)
    }

    /// [`Config::validate`] of a configuration reloaded ([`crate::reload`]): the TLS files and
    /// `--api-key-file` are not read (the TLS files only named together); a reload reads them
    /// apart, and one it cannot read leaves the certificate or keys in use without holding back
    /// the rest. Nor are the tokenizer's files, which only a start reads.
    pub fn validate_for_reload(&self) -> Result<(), Vec<String>> {
        self.problems(false)
    }

    /// Why the tokenizer's files could not be read: a start would fail. A reload only warns
    /// ([`crate::reload`]): they are read at a start.
    pub fn tokenizer_problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Some(problem) = (self.tokenizer.as_ref())
            .and_then(|p| kvroute_proto::openai::tokenizer_path_problem("--tokenizer", p))
        {
            problems.push(problem);
        }
        for (flag, path) in
            [("--tokenizer-config", &self.tokenizer_config), ("--chat-template", &self.chat_template)]
        {
            if let Some(p) = path.as_ref().filter(|p| !p.is_file()) {
                problems.push(format!("{flag} {} is not a readable file", p.display()));
            }
        }
        problems
    }

    /// Every problem of the configuration, with the TLS files and the key file read when
    /// `read_files`.
    fn problems(&self, read_files: bool) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        let mut check = |ok: bool, msg: String| {
            if !ok {
                errors.push(msg);
            }
        };
        check(!self.model.is_empty(), "--model must not be empty".into());
        check(
            !self.lora_adapters.iter().any(|a| a.trim().is_empty()),
            "--lora-adapters must not name an empty adapter".into(),
        );
        check(self.block_size > 0, "--block-size must be at least 1".into());
        for (flag, weight) in self.cache_aware_params().by_flag() {
            check(
                CacheAwareParams::in_range(weight),
                format!("{flag} must be between 0 and {MAX_WEIGHT:e}, got {weight:?}"),
            );
        }
        check(self.connect_timeout_ms > 0, "--connect-timeout-ms must be at least 1".into());
        check(self.events_fallback_ms > 0, "--events-fallback-ms must be at least 1".into());
        check(self.replay_timeout_ms > 0, "--replay-timeout-ms must be at least 1".into());
        check(self.snapshot_timeout_ms > 0, "--snapshot-timeout-ms must be at least 1".into());
        check(self.predicted_ttl_ms > 0, "--predicted-ttl-ms must be at least 1".into());
        check(
            self.predicted_cache_tokens >= self.block_size as usize,
            "--predicted-cache-tokens must be at least one block".into(),
        );
        check(self.first_byte_timeout_ms > 0, "--first-byte-timeout-ms must be at least 1".into());
        check(self.pd_prefill_timeout_ms > 0, "--pd-prefill-timeout-ms must be at least 1".into());
        // Both are timed from the send, connecting included: a replica still connecting when
        // its answer is due would end as a timeout (a 504; a prefill's fallback), not as one
        // that could not be reached, which the next replica is tried for.
        for (flag, timeout) in [
            ("--first-byte-timeout-ms", self.first_byte_timeout_ms),
            ("--pd-prefill-timeout-ms", self.pd_prefill_timeout_ms),
        ] {
            check(
                self.connect_timeout_ms < timeout,
                format!(
                    "--connect-timeout-ms ({}) must be less than {flag} ({timeout}): a replica still \
                     connecting when its answer is due would not be counted unreachable",
                    self.connect_timeout_ms
                ),
            );
        }
        check(self.control_timeout_ms > 0, "--control-timeout-ms must be at least 1".into());
        check(self.tokenize_timeout_ms > 0, "--tokenize-timeout-ms must be at least 1".into());
        check(self.idle_timeout_ms > 0, "--idle-timeout-ms must be at least 1".into());
        check(self.send_timeout_ms > 0, "--send-timeout-ms must be at least 1".into());
        check(self.max_body_bytes > 0, "--max-body-bytes must be at least 1".into());
        check(self.response_owners > 0, "--response-owners must be at least 1".into());
        let most = tokio::sync::Semaphore::MAX_PERMITS;
        check((1..=most).contains(&self.max_in_flight), format!("--max-in-flight must be 1 to {most}"));
        check((1..=most).contains(&self.max_connections), format!("--max-connections must be 1 to {most}"));
        check(
            self.http_threads <= MAX_HTTP_THREADS,
            format!("--http-threads must be at most {MAX_HTTP_THREADS} (0: one per core)"),
        );
        check(
            self.max_header_bytes >= MIN_HEADER_BYTES,
            format!("--max-header-bytes must be at least {MIN_HEADER_BYTES}"),
        );
        check(self.max_prompt_tokens > 0, "--max-prompt-tokens must be at least 1".into());
        check(self.max_completion_tokens > 0, "--max-completion-tokens must be at least 1".into());
        check(self.max_in_flight_per_replica > 0, "--max-in-flight-per-replica must be at least 1".into());
        check(
            self.max_in_flight_per_key == 0 || !self.api_key.is_empty() || self.api_key_file.is_some(),
            "--max-in-flight-per-key counts each client key's requests: give the keys (--api-key or --api-key-file)"
                .into(),
        );
        check(
            self.max_queued <= MAX_QUEUED,
            format!("--max-queued must be at most {MAX_QUEUED} (0: no request waits)"),
        );
        check(
            self.queue_timeout_ms <= MAX_QUEUE_TIMEOUT_MS,
            format!(
                "--queue-timeout-ms must be at most {MAX_QUEUE_TIMEOUT_MS} (an hour; 0: no request waits)"
            ),
        );
        check(self.health_interval_ms > 0, "--health-interval-ms must be at least 1".into());
        check(self.health_timeout_ms > 0, "--health-timeout-ms must be at least 1".into());
        check(self.unhealthy_after > 0, "--unhealthy-after must be at least 1".into());
        check(self.eject_after > 0, "--eject-after must be at least 1".into());
        check(
            self.api_key
                .iter()
                .all(|key| !key.expose().is_empty() && !key.expose().contains(char::is_whitespace)),
            "--api-key must not be empty or hold whitespace (keys are comma-separated, without spaces)"
                .into(),
        );
        check(
            self.replica_authorization().is_some() == self.replica_api_key.is_some(),
            "--replica-api-key must not be empty or hold whitespace".into(),
        );
        check(
            self.replica_api_key.is_none() || self.replica_api_key_file.is_none(),
            "--replica-api-key and --replica-api-key-file: one or the other".into(),
        );
        if let (true, Some(path)) = (read_files, &self.replica_api_key_file)
            && let Err(problem) = ReplicaKeyFile::open(Some(path))
        {
            check(false, format!("--replica-api-key-file {problem}"));
        }
        check(
            self.admin_listen.ip().is_loopback()
                || self.admin_token.as_ref().is_some_and(|t| !t.expose().is_empty()),
            format!("--admin-token is required when the admin service listens on {}", self.admin_listen),
        );
        check(
            !self.admin_tls || self.tls_cert.is_some(),
            "--admin-tls needs --tls-cert and --tls-key: the admin service serves the proxy's certificate"
                .into(),
        );
        check(
            !self.admin_token.as_ref().is_some_and(|t| t.expose().chars().any(|c| !c.is_ascii_graphic())),
            "--admin-token must be printable ASCII without whitespace (a newline at the end of its file?): \
             gRPC metadata carries nothing else, so no client could send it"
                .into(),
        );
        // The tokenizer's files, read at a start only (a reload cannot change them: one gone
        // since, a cache cleaned, would hold back every reload).
        if read_files {
            for problem in self.tokenizer_problems() {
                check(false, problem);
            }
        }
        let tls = if read_files { self.tls().map(drop) } else { self.tls_files().map(drop) };
        if let Err(problem) = tls {
            check(false, problem);
        }
        if let Err(problem) = if read_files {
            self.replica_tls_files_read().map(drop)
        } else {
            self.replica_tls_files().map(drop)
        } {
            check(false, problem);
        }
        if let Err(problem) = self.replica_tls_server_name() {
            check(false, problem);
        }
        if let (true, Some(path)) = (read_files, &self.api_key_file)
            && let Err(problem) = KeyFile::open(Some(path))
        {
            check(false, format!("--api-key-file {problem}"));
        }
        for problem in self.discovery.validate().err().unwrap_or_default() {
            check(false, problem);
        }
        for problem in self.chat.problems() {
            check(false, problem);
        }
        // The listeners, which would fail to bind at start, after the rest is under way.
        let mut listeners = vec![("--listen", self.listen), ("--admin-listen", self.admin_listen)];
        listeners.extend(self.health_listen.map(|at| ("--health-listen", at)));
        for (i, (flag, at)) in listeners.iter().enumerate() {
            for (other, then) in &listeners[..i] {
                let overlap = at.ip() == then.ip() || at.ip().is_unspecified() || then.ip().is_unspecified();
                check(
                    at.port() == 0 || at.port() != then.port() || !overlap,
                    format!("{flag} {at} and {other} {then} would take one port"),
                );
            }
        }
        let mut names = std::collections::HashSet::new();
        let mut servers = std::collections::HashMap::new();
        // Each rank's event stream (endpoint and topic) is one replica's: two replicas on
        // one (a copy-paste slip) would each be credited with the other's cache.
        let mut streams: Vec<((String, &str), &str)> = Vec::new();
        for r in &self.replicas {
            for stream in crate::replicas::event_streams(&r.events, r.dp_size, &r.topic) {
                let taken = streams
                    .iter()
                    .find(|(s, other)| *other != r.name && crate::replicas::one_stream(s, &stream));
                if let Some(((_, topic), other)) = taken {
                    let topics = (topic.to_string(), r.topic.clone());
                    let named = crate::replicas::stream_named(&stream.0, &topics);
                    check(
                        false,
                        format!("replicas {other:?} and {:?} follow one event stream, {named}", r.name),
                    );
                }
                streams.push((stream, r.name.as_str()));
            }
            let named_once = names.insert(r.name.as_str());
            check(named_once, format!("replica {:?} is listed twice", r.name));
            if named_once
                && let Some(other) = servers.insert(crate::replicas::server_of(&r.http), r.name.as_str())
            {
                check(
                    false,
                    format!("replicas {other:?} and {:?} have one HTTP address, {}", r.name, r.http),
                );
            }
            for problem in r.to_spec(&self.model, self.block_size).problems() {
                check(false, format!("replica {:?}: {problem}", r.name));
            }
            let http = base_url(&r.http);
            check(
                http.is_ok(),
                format!(
                    "replica {:?}: http {}",
                    r.name,
                    http.err().map(|e| e.to_string()).unwrap_or_default()
                ),
            );
        }
        if errors.is_empty() { Ok(()) } else { Err(errors) }
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
    pub fn tokenize_timeout(&self) -> Duration {
        Duration::from_millis(self.tokenize_timeout_ms)
    }
    pub fn first_byte_timeout(&self) -> Duration {
        Duration::from_millis(self.first_byte_timeout_ms)
    }
    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.drain_timeout_ms)
    }
    pub fn control_timeout(&self) -> Duration {
        Duration::from_millis(self.control_timeout_ms)
    }
    /// How long a request may wait for room, if requests wait at all.
    pub fn queue_timeout(&self) -> Option<Duration> {
        (self.max_queued > 0 && self.queue_timeout_ms > 0)
            .then(|| Duration::from_millis(self.queue_timeout_ms))
    }
    pub fn idle_timeout(&self) -> Duration {
        Duration::from_millis(self.idle_timeout_ms)
    }
    pub fn send_timeout(&self) -> Duration {
        Duration::from_millis(self.send_timeout_ms)
    }
    pub fn health_interval(&self) -> Duration {
        Duration::from_millis(self.health_interval_ms)
    }
    pub fn ejection(&self) -> Duration {
        Duration::from_millis(self.ejection_ms)
    }
    pub fn credit_ttl(&self) -> Duration {
        Duration::from_millis(self.credit_ttl_ms)
    }

    /// The event ingestion's settings: its defaults, with the timeouts given here.
    pub fn ingest(&self) -> crate::ingest::IngestConfig {
        crate::ingest::IngestConfig {
            fallback_after: Duration::from_millis(self.events_fallback_ms),
            replay_timeout: Duration::from_millis(self.replay_timeout_ms),
            snapshot_timeout: Duration::from_millis(self.snapshot_timeout_ms),
            predicted_ttl: Duration::from_millis(self.predicted_ttl_ms),
            predicted_cache_tokens: self.predicted_cache_tokens,
            ..crate::ingest::IngestConfig::default()
        }
    }

    /// Whether every replica the router knows of at start runs SGLang (the `--replica` list,
    /// and discovery's engine when discovery is on), which renders chats as SGLang does
    /// (gpt-oss's with the model's template rather than with Harmony as vLLM does).
    pub fn sglang_fleet(&self) -> bool {
        let discovered = (self.discovery.discovery != crate::discovery::DiscoveryMode::Static)
            .then_some(self.discovery.discovery_engine);
        let mut engines = self.replicas.iter().map(|r| r.engine).chain(discovered).peekable();
        engines.peek().is_some() && engines.all(|e| e == EngineKind::Sglang)
    }

    /// Threads serving proxy connections ([`Config::http_threads`], 0 resolved).
    pub fn http_threads(&self) -> usize {
        match self.http_threads {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        }
    }

    /// Limits of the proxy's HTTP server.
    pub fn serve_limits(&self) -> Limits {
        Limits {
            max_connections: self.max_connections,
            max_header_bytes: self.max_header_bytes,
            send_timeout: self.send_timeout(),
            // Past the drain timeout, the streams' error events have this long to go out.
            drain_timeout: Some(self.drain_timeout() + DRAIN_END),
            ..Limits::default()
        }
    }

    /// The proxy listener's TLS (`--tls-cert`, `--tls-key`, `--tls-client-ca`), its files
    /// read; `None` without.
    pub fn tls(&self) -> Result<Option<Tls>, String> {
        let Some(files) = self.tls_files()? else { return Ok(None) };
        let flags = match files.client_ca {
            Some(_) => "--tls-cert, --tls-key, --tls-client-ca",
            None => "--tls-cert, --tls-key",
        };
        Tls::from_files(&files).map(Some).map_err(|e| format!("{flags}: {e}"))
    }

    /// The files of [`Config::tls`], named together as they must be.
    pub fn tls_files(&self) -> Result<Option<TlsFiles>, String> {
        match (&self.tls_cert, &self.tls_key, &self.tls_client_ca) {
            (Some(cert), Some(key), client_ca) => {
                Ok(Some(TlsFiles { cert: cert.clone(), key: key.clone(), client_ca: client_ca.clone() }))
            }
            (None, None, None) => Ok(None),
            (None, None, Some(_)) => Err("--tls-client-ca needs --tls-cert and --tls-key".into()),
            _ => Err("--tls-cert and --tls-key go together".into()),
        }
    }

    /// The TLS of connections to `https://` replicas (`--replica-ca-cert`,
    /// `--replica-client-cert`, `--replica-client-key`), its files read.
    pub fn replica_tls(&self) -> Result<ReplicaTls, String> {
        let name = self.replica_tls_server_name()?;
        Ok(self.replica_tls_files_read()?.with_server_name(name))
    }

    /// [`Config::replica_tls`] without its server name.
    fn replica_tls_files_read(&self) -> Result<ReplicaTls, String> {
        ReplicaTls::from_files(&self.replica_tls_files()?)
            .map_err(|e| format!("--replica-ca-cert, --replica-client-cert, --replica-client-key: {e}"))
    }

    /// `--replica-tls-server-name`, if given and a name a certificate can hold.
    fn replica_tls_server_name(&self) -> Result<Option<ServerName<'static>>, String> {
        let Some(name) = &self.replica_tls_server_name else { return Ok(None) };
        match ServerName::try_from(name.as_str()) {
            Ok(parsed) => Ok(Some(parsed.to_owned())),
            Err(e) => Err(format!("--replica-tls-server-name {name:?}: {e}")),
        }
    }

    /// The files of [`Config::replica_tls`], named together as they must be.
    pub fn replica_tls_files(&self) -> Result<ClientFiles, String> {
        let identity = match (&self.replica_client_cert, &self.replica_client_key) {
            (Some(cert), Some(key)) => Some((cert.clone(), key.clone())),
            (None, None) => None,
            _ => return Err("--replica-client-cert and --replica-client-key go together".into()),
        };
        Ok(ClientFiles { ca: self.replica_ca_cert.clone(), identity })
    }

    /// The `Authorization` value of `--replica-api-key`, marked sensitive (kept out of logs and
    /// of HTTP/2's header compression tables); `None` without one, or if it cannot be one.
    pub fn replica_authorization(&self) -> Option<HeaderValue> {
        bearer(self.replica_api_key.as_ref().map(Secret::expose)?)
    }

    /// Limits checked on every routed request before it is forwarded.
    pub fn request_limits(&self) -> RequestLimits {
        RequestLimits {
            max_prompt_tokens: self.max_prompt_tokens,
            max_completion_tokens: self.max_completion_tokens,
        }
    }
}

/// Secrets from a config file, as a list or a comma-separated string (as on the command
/// line); a value of another type is refused without repeating it.
fn comma_separated<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<Secret>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Given {
        One(String),
        Many(Vec<String>),
    }
    match Given::deserialize(deserializer) {
        Ok(Given::One(keys)) => Ok(keys.split(',').map(Secret::new).collect()),
        Ok(Given::Many(keys)) => Ok(keys.into_iter().map(Secret::new).collect()),
        Err(_) => Err(serde::de::Error::custom("expected a string or a list of strings")),
    }
}

/// A secret setting (the admin token, the API keys): its `Debug` never shows the value, so logging a
/// `Config` cannot leak it; [`Secret::expose`] is the one way to read it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The secret itself, for the one place that compares it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl FromStr for Secret {
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Self::new(s))
    }
}

impl From<&str> for Secret {
    fn from(s: &str) -> Self {
        Self::new(s)
    }
}

/// One statically configured replica.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ReplicaConfig {
    pub name: String,
    /// Base URL of its OpenAI API, e.g. `http://10.0.0.7:8000`.
    pub http: String,
    /// ZeroMQ PUB endpoint of its KV events (rank 0); none (empty) for a replica without
    /// events, whose cache is predicted.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub events: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay: Option<String>,
    /// gRPC ReplicaAgent endpoint (kvroute agents), for snapshots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grpc: Option<String>,
    #[serde(default = "default_engine")]
    pub engine: EngineKind,
    #[serde(default = "one")]
    pub dp_size: u32,
    #[serde(default)]
    pub topic: String,
    /// Prefill, decode or both (the default): [`crate::proxy::disagg`].
    #[serde(default, skip_serializing_if = "is_both")]
    pub role: Role,
    /// An SGLang prefill replica's bootstrap port, named to its decode replicas (none: theirs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

fn is_both(role: &Role) -> bool {
    *role == Role::Both
}

fn default_engine() -> EngineKind {
    EngineKind::Kvroute
}
fn one() -> u32 {
    1
}

impl ReplicaConfig {
    /// The registry's spec for this replica.
    pub fn to_spec(&self, model: &str, block_size: u32) -> ReplicaSpec {
        let mut spec = ReplicaSpec::new(self.name.clone(), self.events.clone(), self.engine, model);
        spec.http_url = self.http.trim_end_matches('/').to_owned();
        spec.replay_endpoint = self.replay.clone().filter(|r| !r.is_empty());
        spec.grpc_endpoint = self.grpc.clone().filter(|g| !g.is_empty());
        spec.dp_size = self.dp_size;
        spec.topic = self.topic.clone();
        spec.block_size = Some(block_size);
        spec.role = self.role;
        spec.bootstrap_port = self.bootstrap_port;
        spec
    }
}

impl FromStr for ReplicaConfig {
    type Err = String;

    /// `name=..,http=..[,events=..][,replay=..][,grpc=..][,engine=..][,dp-size=..][,topic=..]`
    /// `[,role=..][,bootstrap-port=..]`
    fn from_str(s: &str) -> Result<Self, String> {
        let mut table = toml::Table::new();
        for part in s.split(',').filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| format!("{part:?} is not key=value"))?;
            let value = match k.trim() {
                key @ ("dp-size" | "dp_size" | "bootstrap-port" | "bootstrap_port") => toml::Value::Integer(
                    v.trim().parse().map_err(|_| format!("{key} {v:?} is not a number"))?,
                ),
                _ => toml::Value::String(v.trim().to_owned()),
            };
            table.insert(k.trim().replace('_', "-"), value);
        }
        ReplicaConfig::deserialize(table).map_err(|e| e.to_string())
    }
}

impl fmt::Display for ReplicaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "name={},http={}", self.name, self.http)?;
        if !self.events.is_empty() {
            write!(f, ",events={}", self.events)?;
        }
        if let Some(r) = &self.replay {
            write!(f, ",replay={r}")?;
        }
        if let Some(g) = &self.grpc {
            write!(f, ",grpc={g}")?;
        }
        let engine = match self.engine {
            EngineKind::Kvroute => "kvroute",
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        };
        write!(f, ",engine={engine},dp-size={}", self.dp_size)?;
        if !self.topic.is_empty() {
            write!(f, ",topic={}", self.topic)?;
        }
        if self.role != Role::Both {
            write!(f, ",role={}", self.role.as_str())?;
        }
        if let Some(port) = self.bootstrap_port {
            write!(f, ",bootstrap-port={port}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a connect timeout as long as the first byte's let a replica that took
    /// the connection but never finished the TLS handshake answer 504, with no retry.
    #[test]
    fn the_connect_timeout_is_within_the_first_bytes() {
        let slow =
            Config { connect_timeout_ms: 2_000, first_byte_timeout_ms: 300, ..Config::loopback(Vec::new()) };
        let errors = slow.validate().unwrap_err();
        assert!(errors.iter().any(|e| e.contains("--connect-timeout-ms (2000)")), "{errors:?}");
        let within = Config { connect_timeout_ms: 200, ..slow };
        assert_eq!(within.validate(), Ok(()));
        let prefill = Config { pd_prefill_timeout_ms: 150, ..within };
        let errors = prefill.validate().unwrap_err();
        assert!(errors.iter().any(|e| e.contains("--pd-prefill-timeout-ms (150)")), "{errors:?}");
    }

    #[test]
    fn a_limit_per_key_needs_the_keys() {
        let limited = Config { max_in_flight_per_key: 4, ..Config::loopback(Vec::new()) };
        let errors = limited.validate().unwrap_err();
        assert!(errors.iter().any(|e| e.contains("--max-in-flight-per-key")), "{errors:?}");
        let keyed = Config { api_key: vec!["sk".into()], ..limited };
        assert_eq!(keyed.validate(), Ok(()));
    }

    /// An empty adapter name (`KVROUTE_LORA_ADAPTERS=`, or a stray comma) is refused: it
    /// was listed as a model named "".
    #[test]
    fn empty_lora_adapter_names_are_refused() {
        for adapters in [vec![String::new()], vec!["sql".into(), " ".into()]] {
            let config = Config { lora_adapters: adapters, ..Config::loopback(Vec::new()) };
            let errors = config.validate().unwrap_err();
            assert!(errors.iter().any(|e| e.contains("--lora-adapters")), "{errors:?}");
        }
        let named = Config { lora_adapters: vec!["sql".into()], ..Config::loopback(Vec::new()) };
        assert!(named.validate().is_ok());
    }

    #[test]
    fn replica_flag_parses() {
        let r: ReplicaConfig =
            "name=r0,http=http://127.0.0.1:8000,events=tcp://127.0.0.1:5557,engine=vllm,dp-size=2"
                .parse()
                .unwrap();
        assert_eq!(r.engine, EngineKind::Vllm);
        assert_eq!(r.dp_size, 2);
        assert_eq!(r.replay, None);
        assert_eq!(r.to_string().parse::<ReplicaConfig>().unwrap(), r);
        let predicted = "name=r0,http=http://127.0.0.1:8000".parse::<ReplicaConfig>().unwrap();
        assert_eq!(predicted.events, "", "a replica without events");
        assert_eq!(predicted.role, Role::Both);
        assert_eq!(predicted.to_string().parse::<ReplicaConfig>(), Ok(predicted));
        assert!("name=r0,http=x,events=y,bogus=1".parse::<ReplicaConfig>().is_err());
        assert!("name=r0,http=x,events=y,engine=tgi".parse::<ReplicaConfig>().is_err());
        let prefill = "name=r0,http=http://127.0.0.1:8000,role=prefill".parse::<ReplicaConfig>().unwrap();
        assert_eq!(prefill.role, Role::Prefill);
        assert_eq!(prefill.to_spec("m", 16).role, Role::Prefill);
        assert_eq!(prefill.to_string().parse::<ReplicaConfig>(), Ok(prefill));
        assert!("name=r0,http=x,role=encode".parse::<ReplicaConfig>().is_err());
        let sglang = "name=p0,http=http://10.0.0.7:30000,engine=sglang,role=prefill,bootstrap-port=8998";
        let sglang = sglang.parse::<ReplicaConfig>().unwrap();
        assert_eq!(sglang.to_spec("m", 16).bootstrap_port, Some(8998));
        assert_eq!(sglang.to_string().parse::<ReplicaConfig>(), Ok(sglang.clone()), "{sglang}");
        assert!("name=p0,http=x,bootstrap-port=70000".parse::<ReplicaConfig>().is_err());
    }

    /// Only a fleet of SGLang replicas, listed or discovered, is one (its gpt-oss chats are
    /// rendered with the template).
    #[test]
    fn an_sglang_fleet_is_all_sglang() {
        let config = |args: &[&str]| -> Config {
            let replica = |engine: &str| {
                format!("name={engine},http=http://127.0.0.1:1,events=tcp://127.0.0.1:2,engine={engine}")
            };
            let mut all = vec!["r".to_owned()];
            for a in args {
                match a.strip_prefix("engine:") {
                    Some(engine) => all.extend(["--replica".to_owned(), replica(engine)]),
                    None => all.push((*a).to_owned()),
                }
            }
            kvroute_proto::cli::parse_from(all).unwrap()
        };
        assert!(config(&["engine:sglang"]).sglang_fleet());
        assert!(!config(&["engine:sglang", "engine:vllm"]).sglang_fleet());
        assert!(!config(&["engine:vllm"]).sglang_fleet());
        assert!(!config(&[]).sglang_fleet(), "no replica at all");
        let dns = ["--discovery", "dns", "--discovery-service", "s.local"];
        assert!(!config(&dns).sglang_fleet(), "discovered replicas run the agent by default");
        let sglang_dns = [&dns[..], &["--discovery-engine", "sglang", "engine:sglang"]].concat();
        assert!(config(&sglang_dns).sglang_fleet());
    }

    /// `text` written to `router.toml` in a directory of its own (`tag`), and that directory.
    fn config_file(tag: &str, text: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("kvroute-router-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("router.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn file_replicas_and_flags_merge() {
        let (dir, path) = config_file(
            "config",
            "policy = \"round-robin\"\nblock-size = 32\n[[replica]]\nname = \"a\"\nhttp = \"http://127.0.0.1:1\"\nevents = \"tcp://127.0.0.1:2\"\n",
        );
        let c: Config =
            kvroute_proto::cli::parse_from(["r", "--config", path.to_str().unwrap(), "--block-size", "64"])
                .unwrap();
        assert_eq!(c.policy, PolicyKind::RoundRobin);
        assert_eq!(c.block_size, 64, "the flag wins over the file");
        assert_eq!(c.replicas.len(), 1);
        assert_eq!(c.validate(), Ok(()));
        std::fs::remove_dir_all(dir).ok();
    }

    /// The fleet's chat flags, from the file and from flags, as vLLM spells them; an effort
    /// vLLM does not know is refused either way.
    #[test]
    fn chat_options_come_from_the_file_and_flags() {
        let (dir, path) = config_file(
            "chat",
            "trust-request-chat-template = true\nchat-template-content-format = \"openai\"\n\
             reasoning-effort-map = { huge = \"max\" }\n[default-chat-template-kwargs]\nenable_thinking = false\n",
        );
        let file = path.to_str().unwrap();
        let c: Config = kvroute_proto::cli::parse_from(["r", "--config", file]).unwrap();
        assert!(c.chat.trust_request_chat_template);
        assert_eq!(c.chat.chat_template_content_format, kvroute_proto::openai::ContentFormatOption::Openai);
        let kwargs = c.chat.default_chat_template_kwargs.as_ref().unwrap();
        assert_eq!(kwargs.get("enable_thinking"), Some(&serde_json::Value::Bool(false)));
        assert_eq!(c.validate().unwrap_err().len(), 1, "the file's unknown effort");
        let c: Config = kvroute_proto::cli::parse_from([
            "r",
            "--config",
            file,
            "--reasoning-effort-map",
            r#"{"medium": "low"}"#,
            "--exclude-tools-when-tool-choice-none",
        ])
        .unwrap();
        assert_eq!(c.chat.reasoning_effort_map, Some([("medium".into(), "low".into())].into()));
        assert!(c.chat.exclude_tools_when_tool_choice_none);
        assert_eq!(c.validate(), Ok(()));
        for bad in [r#"{"huge": "max"}"#, "[1]", r#"{"low": 1}"#] {
            let parsed = kvroute_proto::cli::parse_from::<Config, _, _>(["r", "--reasoning-effort-map", bad]);
            assert!(parsed.is_err(), "{bad}");
        }
        let parsed =
            kvroute_proto::cli::parse_from::<Config, _, _>(["r", "--default-chat-template-kwargs", "[]"]);
        assert!(parsed.is_err(), "not an object");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let bad = ReplicaConfig {
            name: "a".into(),
            http: "ftp://x".into(),
            events: "nowhere".into(),
            replay: None,
            grpc: None,
            engine: EngineKind::Kvroute,
            dp_size: 1,
            topic: String::new(),
            role: Role::Both,
            bootstrap_port: None,
        };
        let c = Config {
            block_size: 0,
            admin_listen: "0.0.0.0:1".parse().unwrap(),
            replicas: vec![bad.clone(), bad],
            ..Config::default()
        };
        let errors = c.validate().unwrap_err();
        // block size, admin token, duplicate name, 2x bad events, 2x bad http
        assert_eq!(errors.len(), 7, "{errors:#?}");
        let c = Config {
            replay_timeout_ms: 0,
            snapshot_timeout_ms: 0,
            events_fallback_ms: 0,
            ..Config::default()
        };
        assert_eq!(c.validate().unwrap_err().len(), 3);
    }

    #[test]
    fn debug_output_redacts_the_admin_token() {
        let c: Config =
            kvroute_proto::cli::parse_from(["r", "--admin-token", "hunter2-very-secret"]).unwrap();
        assert_eq!(c.admin_token.as_ref().map(Secret::expose), Some("hunter2-very-secret"));
        let debug = format!("{c:?} {c:#?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("redacted"));
        for bad in ["hunter2\n", "hunter\u{7f}2", "hünter2"] {
            let c: Config = kvroute_proto::cli::parse_from(["r", "--admin-token", bad]).unwrap();
            assert!(c.validate().unwrap_err()[0].contains("printable ASCII without whitespace"), "{bad:?}");
        }
    }

    #[test]
    fn api_keys_are_a_list_redacted_in_debug_output_and_never_empty() {
        let c: Config = kvroute_proto::cli::parse_from(["r", "--api-key", "sk-first,sk-second"]).unwrap();
        let keys: Vec<&str> = c.api_key.iter().map(Secret::expose).collect();
        assert_eq!(keys, ["sk-first", "sk-second"]);
        let debug = format!("{c:?} {c:#?}");
        assert!(!debug.contains("sk-"), "{debug}");
        for bad in ["sk-first,", "sk-first, sk-second", "sk-first\n"] {
            let c: Config = kvroute_proto::cli::parse_from(["r", "--api-key", bad]).unwrap();
            assert!(
                c.validate().unwrap_err()[0].contains("--api-key must not be empty or hold whitespace"),
                "{bad:?}"
            );
        }
    }

    /// `--replica-api-key` is sent as a sensitive bearer, redacted in `Debug`; one no header
    /// could carry as sent is refused up front.
    #[test]
    fn the_replicas_key_is_a_hidden_bearer() {
        let c: Config = kvroute_proto::cli::parse_from(["r", "--replica-api-key", "sk-fleet"]).unwrap();
        let value = c.replica_authorization().unwrap();
        assert_eq!((value.to_str().unwrap(), value.is_sensitive()), ("Bearer sk-fleet", true));
        assert!(!format!("{c:?}").contains("sk-fleet"));
        for bad in ["", "sk fleet", "sk-fleet\n"] {
            let c: Config = kvroute_proto::cli::parse_from(["r", "--replica-api-key", bad]).unwrap();
            assert!(c.replica_authorization().is_none(), "{bad:?}");
            assert!(c.validate().unwrap_err()[0].contains("--replica-api-key must not"), "{bad:?}");
        }
    }

    /// In a config file the keys are a list or a comma-separated string; a value of another
    /// type is refused without being repeated in the error.
    #[test]
    fn api_keys_in_a_file_are_a_list_or_a_string() {
        let parsed = |tag: &str, text: &str| {
            let (dir, path) = config_file(tag, text);
            let parsed =
                kvroute_proto::cli::parse_from::<Config, _, _>(["r", "--config", path.to_str().unwrap()]);
            std::fs::remove_dir_all(dir).ok();
            parsed
        };
        for (tag, text) in
            [("keys-list", r#"api-key = ["sk-a", "sk-b"]"#), ("keys-string", r#"api-key = "sk-a,sk-b""#)]
        {
            let c = parsed(tag, text).unwrap();
            assert_eq!(c.api_key.iter().map(Secret::expose).collect::<Vec<_>>(), ["sk-a", "sk-b"], "{tag}");
        }
        let refused = parsed("keys-number", "api-key = 41414141").unwrap_err().to_string();
        assert!(refused.contains("api-key") && !refused.contains("41414141"), "{refused}");
    }

    #[test]
    fn limits_have_safe_defaults_and_are_checked() {
        let c = Config::default();
        let drain = Some(c.drain_timeout() + DRAIN_END);
        assert_eq!(c.serve_limits(), Limits { drain_timeout: drain, ..Limits::default() });
        assert!(c.max_connections > 0 && c.max_header_bytes >= MIN_HEADER_BYTES);
        let bad = Config {
            max_connections: 0,
            max_header_bytes: 100,
            max_prompt_tokens: 0,
            max_completion_tokens: 0,
            http_threads: MAX_HTTP_THREADS + 1,
            ..Config::default()
        };
        assert_eq!(bad.validate().unwrap_err().len(), 5);
        assert!(Config::default().http_threads() >= 1, "0 resolves to the core count");
        // Beyond what a semaphore holds: refused here, not a panic at start.
        let huge = Config { max_in_flight: usize::MAX, max_connections: usize::MAX, ..Config::default() };
        assert_eq!(huge.validate().unwrap_err().len(), 2);
    }

    /// Every problem of a replica at once, a bind address for its events among them.
    #[test]
    fn a_replicas_problems_are_all_reported() {
        let replica = "name=r0,http=http://h:1,events=tcp://*:5557,replay=nowhere,grpc=h:50051,dp-size=2";
        let c = Config { replicas: vec![replica.parse().unwrap()], ..Config::default() };
        let errors = c.validate().unwrap_err();
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(
            errors.iter().any(|e| e.contains("tcp://*:5557") && e.contains("bind address")),
            "{errors:?}"
        );
    }

    /// A replica without events is one rank with nothing to repair from: what only a stream
    /// serves is refused, and a replica with neither events nor an HTTP address is nothing.
    #[test]
    fn a_replica_without_events_takes_no_stream_settings() {
        let problems = |replica: &str| {
            let c = Config { replicas: vec![replica.parse().unwrap()], ..Config::default() };
            c.validate().err().unwrap_or_default()
        };
        assert_eq!(problems("name=r0,http=http://h:1"), Vec::<String>::new());
        let errors = problems("name=r0,http=http://h:1,dp-size=2,replay=tcp://h:5558,topic=kv");
        assert_eq!(errors.len(), 3, "{errors:?}");
        assert!(errors.iter().all(|e| e.contains("needs an event endpoint")), "{errors:?}");
        let spec = ReplicaSpec::new("r0", "", EngineKind::Vllm, "m");
        assert_eq!(spec.validate(), Err(crate::replicas::SpecError::Nothing));
    }

    /// Two names for one server would split its load and its cache's credit: refused, as
    /// the fleet refuses it now (both were started, and each got half its load).
    #[test]
    fn one_server_is_listed_once() {
        let replica = |name: &str, http: &str| {
            format!("name={name},http={http},events=tcp://{name}:5557").parse().unwrap()
        };
        let c = Config {
            replicas: vec![
                replica("a", "http://h:8000"),
                replica("b", "http://H:8000/"),
                replica("c", "http://h:8001"),
            ],
            ..Config::default()
        };
        let errors = c.validate().unwrap_err();
        assert!(
            errors.len() == 1 && errors[0].contains("\"a\" and \"b\" have one HTTP address"),
            "{errors:?}"
        );
    }

    /// Two listeners on one port would fail to bind at start, after the rest is under way:
    /// refused up front, with the other problems.
    #[test]
    fn listeners_take_ports_of_their_own() {
        let at = |s: &str| s.parse::<SocketAddr>().unwrap();
        let c = Config { health_listen: Some(at("127.0.0.1:8080")), ..Config::default() };
        let errors = c.validate().unwrap_err();
        assert!(
            errors.iter().any(|e| e.contains("--health-listen 127.0.0.1:8080 and --listen")),
            "{errors:?}"
        );
        let apart = Config { health_listen: Some(at("0.0.0.0:8081")), ..Config::default() };
        assert_eq!(apart.validate(), Ok(()));
        let loopback = Config { health_listen: Some(at("127.0.0.1:0")), ..Config::loopback(Vec::new()) };
        assert_eq!(loopback.validate(), Ok(()), "port 0 takes a port of its own");
    }

    /// Each rank's event stream is one replica's: two replicas following one (a copy-paste
    /// slip) would each be credited with the other's cache. Another topic is another stream,
    /// unless one begins the other (a subscription is to a topic prefix).
    #[test]
    fn one_event_stream_is_one_replicas() {
        let config = |replicas: &[&str]| Config {
            replicas: replicas.iter().map(|r| r.parse().unwrap()).collect(),
            ..Config::default()
        };
        let errors = config(&[
            "name=a,http=http://a:8000,events=tcp://h:5557",
            "name=b,http=http://b:8000,events=tcp://h:5557",
        ])
        .validate()
        .unwrap_err();
        assert!(
            errors.len() == 1 && errors[0].contains("\"a\" and \"b\" follow one event stream"),
            "{errors:?}"
        );
        let ranks = config(&[
            "name=a,http=http://a:8000,events=tcp://h:5557,dp-size=2",
            "name=b,http=http://b:8000,events=tcp://h:5558",
        ]);
        assert!(ranks.validate().is_err(), "a's second rank publishes on 5558");
        let topics = config(&[
            "name=a,http=http://a:8000,events=tcp://h:5557,topic=a",
            "name=b,http=http://b:8000,events=tcp://h:5557,topic=b",
        ]);
        assert_eq!(topics.validate(), Ok(()));
        let prefix = config(&[
            "name=a,http=http://a:8000,events=tcp://h:5557,topic=kv",
            "name=b,http=http://b:8000,events=tcp://h:5557,topic=kv@b",
        ]);
        assert!(prefix.validate().is_err(), "a's subscription to kv takes b's kv@b too");
    }

    /// `--tls-cert` and `--tls-key` go together, and their files must hold a certificate and
    /// its key: each problem is reported with the rest, before anything starts.
    #[test]
    fn tls_files_are_checked_up_front() {
        let dir = std::env::temp_dir().join(format!("kvroute-config-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert, key, empty) = (dir.join("c.pem"), dir.join("k.pem"), dir.join("e.pem"));
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        std::fs::write(&empty, "").unwrap();
        let with = |cert: Option<&PathBuf>, key: Option<&PathBuf>| Config {
            tls_cert: cert.cloned(),
            tls_key: key.cloned(),
            ..Config::loopback(Vec::new())
        };
        assert_eq!(with(Some(&cert), Some(&key)).validate(), Ok(()));
        let unreadable = with(Some(&empty), Some(&key));
        assert_eq!(unreadable.validate_for_reload(), Ok(()), "a reload reads the files apart");
        assert!(with(Some(&cert), None).validate_for_reload().is_err());
        assert!(with(Some(&cert), Some(&key)).tls().unwrap().is_some());
        assert!(with(None, None).tls().unwrap().is_none());
        for (config, says) in [
            (with(Some(&cert), None), "go together"),
            (with(None, Some(&key)), "go together"),
            (with(Some(&empty), Some(&key)), "e.pem: no certificate"),
            (with(Some(&cert), Some(&empty)), "e.pem"),
        ] {
            let errors = config.validate().unwrap_err();
            assert!(errors.len() == 1 && errors[0].contains(says), "{errors:?}");
        }
        // Client authorities (mutual TLS): with the server's pair only, and certificates.
        let authorities =
            |ca: &PathBuf| Config { tls_client_ca: Some(ca.clone()), ..with(Some(&cert), Some(&key)) };
        assert_eq!(authorities(&cert).validate(), Ok(()));
        for (config, says) in [
            (
                Config { tls_client_ca: Some(cert.clone()), ..with(None, None) },
                "--tls-client-ca needs --tls-cert",
            ),
            (authorities(&empty), "--tls-client-ca: "),
            (authorities(&key), "k.pem: no certificate"),
        ] {
            let errors = config.validate().unwrap_err();
            assert!(errors.len() == 1 && errors[0].contains(says), "{says}: {errors:?}");
        }
        assert_eq!(authorities(&empty).validate_for_reload(), Ok(()), "a reload reads the files apart");
        let _ = std::fs::remove_dir_all(dir);
    }

    /// `--replica-api-key-file` must hold one key, and goes without `--replica-api-key`.
    #[test]
    fn the_replicas_key_file_is_checked_up_front() {
        let dir = std::env::temp_dir().join(format!("kvroute-config-replica-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (one, two) = (dir.join("one"), dir.join("two"));
        std::fs::write(&one, "sk-replica\n").unwrap();
        std::fs::write(&two, "sk-a,sk-b\n").unwrap();
        let with = |path: &PathBuf| Config {
            replica_api_key_file: Some(path.clone()),
            ..Config::loopback(Vec::new())
        };
        assert_eq!(with(&one).validate(), Ok(()));
        for (path, says) in [(&two, "two: holds 2 keys"), (&dir.join("missing"), "missing: ")] {
            let errors = with(path).validate().unwrap_err();
            assert!(
                errors.len() == 1
                    && errors[0].starts_with("--replica-api-key-file ")
                    && errors[0].contains(says),
                "{errors:?}"
            );
            assert_eq!(with(path).validate_for_reload(), Ok(()), "a reload reads the file apart");
        }
        let both = Config { replica_api_key: Some(Secret::new("sk-flag")), ..with(&one) };
        assert!(both.validate().unwrap_err().iter().any(|e| e.contains("one or the other")));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// The tokenizer's files stop a start that cannot read them, not a reload (which cannot
    /// change them: one removed since held back every reload).
    #[test]
    fn the_tokenizers_files_are_checked_at_a_start_only() {
        let missing = std::env::temp_dir().join(format!("kvroute-config-gone-{}", std::process::id()));
        for config in [
            Config { tokenizer: Some(missing.clone()), ..Config::loopback(Vec::new()) },
            Config { tokenizer_config: Some(missing.clone()), ..Config::loopback(Vec::new()) },
            Config { chat_template: Some(missing.clone()), ..Config::loopback(Vec::new()) },
        ] {
            assert!(config.validate().is_err(), "{config:?}");
            assert_eq!(config.validate_for_reload(), Ok(()));
        }
    }

    /// A key file that cannot be read or holds no key stops the start, with the other
    /// errors; a reload reads it apart.
    #[test]
    fn the_key_file_is_checked_up_front() {
        let dir = std::env::temp_dir().join(format!("kvroute-config-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (keys, empty, missing) = (dir.join("keys"), dir.join("empty"), dir.join("missing"));
        std::fs::write(&keys, "sk-a\nsk-b\n").unwrap();
        std::fs::write(&empty, "\n# none yet\n").unwrap();
        let with =
            |path: &PathBuf| Config { api_key_file: Some(path.clone()), ..Config::loopback(Vec::new()) };
        assert_eq!(with(&keys).validate(), Ok(()));
        for (path, says) in [(&empty, "empty: holds no key"), (&missing, "missing: ")] {
            let errors = with(path).validate().unwrap_err();
            assert!(
                errors.len() == 1 && errors[0].starts_with("--api-key-file ") && errors[0].contains(says),
                "{errors:?}"
            );
            assert_eq!(with(path).validate_for_reload(), Ok(()), "a reload reads the file apart");
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn replicas_are_http_or_https() {
        let with = |http: &str| Config {
            replicas: vec![format!("name=r0,http={http},events=tcp://127.0.0.1:5557").parse().unwrap()],
            ..Config::default()
        };
        assert_eq!(with("http://10.0.0.1:8000").validate(), Ok(()));
        assert_eq!(with("https://replica-0.example").validate(), Ok(()));
        let errors = with("ftp://10.0.0.1:8000").validate().unwrap_err();
        assert!(errors.len() == 1 && errors[0].contains("not an http:// or https:// URL"), "{errors:?}");
    }
}
