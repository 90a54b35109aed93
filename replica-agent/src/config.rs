//! The replica agent's configuration: every knob is a flag with an environment variable
//! (`KVROUTE_AGENT_*`), and may also come from a TOML file given with `--config` (keys are
//! the flag names: `block-size = 16`). Flags win over the environment, which wins over the
//! file, which wins over the defaults. [`Config::validate`] reports every problem at once.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use kvroute_proto::serve::{Limits, MIN_HEADER_BYTES, TlsFiles};
use serde::{Deserialize, Serialize};

use crate::bootstrap::Mode as DisaggregationMode;
use crate::cache::{CacheConfig, PolicyKind, S3FifoParams};
use crate::engine::TimingModel;
use crate::kv_transfer::KvTransferConfig;
use crate::publisher::EventFormat;

/// A simulated vLLM-like inference replica with an exact block-level prefix cache.
#[derive(Parser, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[command(name = "kvroute-agent", version, about, long_about = None)]
#[serde(rename_all = "kebab-case")]
pub struct Config {
    /// TOML file with any of these settings (keys spelled like the flags).
    #[arg(long, env = "KVROUTE_AGENT_CONFIG")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub config: Option<PathBuf>,

    /// Replica name, published in every event batch and in Info.
    #[arg(long, env = "KVROUTE_AGENT_NAME", default_value = "agent-0")]
    pub name: String,
    /// Served model name (`GET /v1/models`, the cache namespace's model).
    #[arg(long, env = "KVROUTE_AGENT_MODEL", default_value = "kvroute-sim")]
    pub model: String,
    /// LoRA adapter names this replica serves, besides the base model (comma-separated).
    #[arg(long, env = "KVROUTE_AGENT_LORA_ADAPTERS", value_delimiter = ',')]
    #[serde(default)]
    pub lora_adapters: Vec<String>,

    /// OpenAI-compatible HTTP API address.
    #[arg(long, env = "KVROUTE_AGENT_HTTP_ADDR", default_value = "127.0.0.1:8000")]
    pub http_addr: SocketAddr,
    /// gRPC ReplicaAgent service address (Info, Snapshot, Stats).
    #[arg(long, env = "KVROUTE_AGENT_GRPC_ADDR", default_value = "127.0.0.1:50051")]
    pub grpc_addr: SocketAddr,
    /// ZeroMQ PUB endpoint for KV events (bound).
    #[arg(long, env = "KVROUTE_AGENT_EVENTS_ENDPOINT", default_value = "tcp://127.0.0.1:5557")]
    pub events_endpoint: String,
    /// ZeroMQ ROUTER endpoint answering replay requests; empty disables replay.
    #[arg(long, env = "KVROUTE_AGENT_REPLAY_ENDPOINT", default_value = "tcp://127.0.0.1:5558")]
    pub replay_endpoint: String,
    /// Data-parallel ranks, as vLLM's `--data-parallel-size`: an engine a rank, each with its
    /// own prefix cache of `--capacity-blocks` and its own event stream, rank r on the events
    /// and replay endpoints' port + r (so the two need that many ports between them: move
    /// the replay endpoint off its default, to 5600 say). A request goes to the rank its
    /// `X-data-parallel-rank` header names, else to the least loaded.
    #[arg(long, env = "KVROUTE_AGENT_DATA_PARALLEL_SIZE", default_value_t = 1)]
    pub data_parallel_size: u32,
    /// Frame 0 of every event message.
    #[arg(long, env = "KVROUTE_AGENT_TOPIC", default_value = "kv-events")]
    pub topic: String,
    /// Event payload encoding: kvroute's protobuf, or vLLM's msgpack.
    #[arg(long, env = "KVROUTE_AGENT_EVENT_FORMAT", value_enum, default_value_t = EventFormat::Kvroute)]
    pub event_format: EventFormat,
    /// Event batches kept for replay.
    #[arg(long, env = "KVROUTE_AGENT_BUFFER_STEPS", default_value_t = 10_000)]
    pub buffer_steps: usize,

    /// Tokens per KV block (vLLM's default is 16).
    #[arg(long, env = "KVROUTE_AGENT_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// Prefix-cache capacity in blocks.
    #[arg(long, env = "KVROUTE_AGENT_CAPACITY_BLOCKS", default_value_t = 8192)]
    pub capacity_blocks: usize,
    /// Blocks of host memory the engine offloads its KV blocks to, and loads a prefix's
    /// next blocks from rather than computing them (vLLM's `OffloadingConnector`); 0: none.
    /// They are published as events of `medium` "CPU".
    #[arg(long, env = "KVROUTE_AGENT_OFFLOAD_BLOCKS", default_value_t = 0)]
    pub offload_blocks: usize,
    /// Eviction policy.
    #[arg(long, env = "KVROUTE_AGENT_POLICY", value_enum, default_value_t = PolicyKind::Lru)]
    pub policy: PolicyKind,
    /// S3FIFO: share of the capacity given to the small queue.
    #[arg(long, env = "KVROUTE_AGENT_S3FIFO_SMALL_RATIO", default_value_t = 0.1)]
    pub s3fifo_small_ratio: f64,
    /// S3FIFO: saturation value of the per-block frequency counter.
    #[arg(long, env = "KVROUTE_AGENT_S3FIFO_MAX_FREQ", default_value_t = 3)]
    pub s3fifo_max_freq: u8,

    /// Longest prompt plus completion accepted, in tokens.
    #[arg(long, env = "KVROUTE_AGENT_MAX_MODEL_LEN", default_value_t = 32_768)]
    pub max_model_len: u32,
    /// Most sequences running at once (continuous batching).
    #[arg(long, env = "KVROUTE_AGENT_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: u32,
    /// Token budget of one step: decode tokens plus prefill chunks.
    #[arg(long, env = "KVROUTE_AGENT_MAX_NUM_BATCHED_TOKENS", default_value_t = 8192)]
    pub max_num_batched_tokens: u32,
    /// Completion length when a request sets no max_tokens (a completion request's is
    /// checked against the context as if asked, as vLLM's default of 16 is).
    #[arg(long, env = "KVROUTE_AGENT_DEFAULT_MAX_TOKENS", default_value_t = 16)]
    pub default_max_tokens: u32,
    /// Most requests waiting for admission before new ones get 503.
    #[arg(long, env = "KVROUTE_AGENT_MAX_WAITING", default_value_t = 4096)]
    pub max_waiting: usize,
    /// The order of waiting requests, as vLLM's flag: `fcfs` (a request with a `priority`
    /// other than 0 gets 400, as vLLM answers it) or `priority` (lower first, then arrival).
    #[arg(long, env = "KVROUTE_AGENT_SCHEDULING_POLICY", value_enum, default_value_t = SchedulingPolicy::Fcfs)]
    pub scheduling_policy: SchedulingPolicy,

    /// HuggingFace tokenizer.json, or the model's directory holding it; the built-in
    /// tokenizer when absent. The tokenizer_config.json beside it (special tokens, the chat
    /// template) is read, as vLLM reads the model's directory.
    #[arg(long, env = "KVROUTE_AGENT_TOKENIZER")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// Jinja chat template file (or a tokenizer_config.json holding `chat_template`), as
    /// vLLM's `--chat-template` (a trusted request's kwargs template is then not used).
    #[arg(long, env = "KVROUTE_AGENT_CHAT_TEMPLATE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
    /// The fleet's vLLM flags that change how chats are rendered (the router's must be the
    /// replicas'; router and agents read the same environment variables).
    #[command(flatten)]
    #[serde(flatten)]
    pub chat: kvroute_proto::openai::ChatOptions,

    /// Simulated seconds per wall-clock second (20 = every latency divided by 20).
    #[arg(long, env = "KVROUTE_AGENT_TIME_SCALE", default_value_t = 1.0)]
    pub time_scale: f64,
    /// Fixed cost of one engine step, microseconds.
    #[arg(long, env = "KVROUTE_AGENT_STEP_BASE_US", default_value_t = 6_000)]
    pub step_base_us: u64,
    /// Prefill cost per uncached prompt token, microseconds.
    #[arg(long, env = "KVROUTE_AGENT_PREFILL_US_PER_TOKEN", default_value_t = 70)]
    pub prefill_us_per_token: u64,
    /// Decode cost per running sequence per step, microseconds.
    #[arg(long, env = "KVROUTE_AGENT_DECODE_US_PER_SEQ", default_value_t = 60)]
    pub decode_us_per_seq: u64,
    /// Seed of the generated text (same prompt and seed, same text).
    #[arg(long, env = "KVROUTE_AGENT_SEED", default_value_t = 0)]
    pub seed: u64,

    /// Seconds the requests accepted (running or waiting) get to finish after SIGTERM; their
    /// KV events are published (and kept for replay) until the engine stops.
    #[arg(long, env = "KVROUTE_AGENT_SHUTDOWN_GRACE_SECS", default_value_t = 30)]
    pub shutdown_grace_secs: u64,
    /// Requests to `/v1/*` must carry `Authorization: Bearer <key>`, as with vLLM's
    /// `--api-key`; others get vLLM's 401. Every path outside `/v1` stays open, as with vLLM:
    /// `/health`, `/metrics`, `/tokenize`, and `/reset_prefix_cache` too (keep it off the network).
    #[arg(long, env = "KVROUTE_AGENT_API_KEY", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// Serve the API over HTTPS with this certificate chain (PEM, the agent's own first), as
    /// vLLM's `--ssl-certfile`. With `--ssl-keyfile`. The gRPC service stays plain. The files
    /// are read at the start only.
    #[arg(long, env = "KVROUTE_AGENT_SSL_CERTFILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssl_certfile: Option<PathBuf>,
    /// The private key of `--ssl-certfile` (PEM), as vLLM's `--ssl-keyfile`.
    #[arg(long, env = "KVROUTE_AGENT_SSL_KEYFILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssl_keyfile: Option<PathBuf>,
    /// With `--ssl-certfile`: clients must show a certificate signed by one of the authorities
    /// in this PEM file (mutual TLS). vLLM's `--ssl-ca-certs` asks for that with
    /// `--ssl-cert-reqs 2`.
    #[arg(long, env = "KVROUTE_AGENT_SSL_CA_CERTS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssl_ca_certs: Option<PathBuf>,
    /// Plays vLLM's disaggregated prefill with this connector config (JSON, as vLLM's flag):
    /// `{"kv_connector":"NixlConnector","kv_role":"kv_both"}` ([`crate::kv_transfer`]).
    #[arg(long, env = "KVROUTE_AGENT_KV_TRANSFER_CONFIG", value_parser = KvTransferConfig::parse)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_transfer_config: Option<KvTransferConfig>,
    /// Plays SGLang's disaggregated prefill (`prefill` or `decode`; `null`: neither): requests
    /// then need `bootstrap_room` ([`crate::bootstrap`]).
    #[arg(long, env = "KVROUTE_AGENT_DISAGGREGATION_MODE", value_enum, default_value_t = DisaggregationMode::Null)]
    pub disaggregation_mode: DisaggregationMode,
    /// A prefill agent's bootstrap server port, on the HTTP address's host (decode agents
    /// use it when a request's `bootstrap_port` is null).
    #[arg(long, env = "KVROUTE_AGENT_DISAGGREGATION_BOOTSTRAP_PORT", default_value_t = crate::bootstrap::DEFAULT_PORT)]
    pub disaggregation_bootstrap_port: u16,
    /// How long a prefill waits for its decode replica, and a decode for its prefill,
    /// milliseconds (SGLang's bootstrap and waiting timeouts).
    #[arg(long, env = "KVROUTE_AGENT_DISAGGREGATION_TIMEOUT_MS", default_value_t = 300_000)]
    pub disaggregation_timeout_ms: u64,
    /// Keep every Responses API response in this process, so a later request can continue it
    /// (`previous_response_id`) or fetch it, and run `background: true` requests, as vLLM with
    /// `VLLM_ENABLE_RESPONSES_API_STORE=1`.
    #[arg(long, env = "KVROUTE_AGENT_RESPONSES_STORE")]
    #[serde(default)]
    pub responses_store: bool,
    /// Largest accepted request body, bytes.
    #[arg(long, env = "KVROUTE_AGENT_MAX_BODY_BYTES", default_value_t = 16 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Longest a request's body may take to arrive, milliseconds; past it, 408. (A client
    /// that stops mid-body would otherwise hold its connection, and a shutdown, for good.)
    #[arg(long, env = "KVROUTE_AGENT_BODY_TIMEOUT_MS", default_value_t = 30_000)]
    pub body_timeout_ms: u64,
    /// HTTP connections open at once; more wait in the listen backlog.
    #[arg(long, env = "KVROUTE_AGENT_MAX_CONNECTIONS", default_value_t = Limits::default().max_connections)]
    pub max_connections: usize,
    /// Largest request head (request line and headers), bytes; larger ones get 431.
    #[arg(long, env = "KVROUTE_AGENT_MAX_HEADER_BYTES", default_value_t = Limits::default().max_header_bytes)]
    pub max_header_bytes: usize,
}

/// The port of a `tcp://host:port` endpoint.
fn tcp_port(endpoint: &str) -> Option<u16> {
    endpoint.strip_prefix("tcp://")?.rsplit_once(':')?.1.parse().ok()
}

/// Most data-parallel ranks one agent runs.
pub const MAX_DATA_PARALLEL_SIZE: u32 = 64;

impl kvroute_proto::cli::Layered for Config {
    fn config_file(&self) -> Option<&Path> {
        self.config.as_deref()
    }
}

impl Default for Config {
    fn default() -> Self {
        kvroute_proto::cli::defaults()
    }
}

/// The order of waiting requests (vLLM's `--scheduling-policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingPolicy {
    /// First come, first served; requests may not set a `priority`.
    #[default]
    Fcfs,
    /// By the requests' `priority` (lower first), then first come, first served.
    Priority,
}

impl Config {
    /// The block cache these settings describe.
    pub fn cache(&self) -> CacheConfig {
        CacheConfig {
            capacity_blocks: self.capacity_blocks,
            block_size: self.block_size as usize,
            policy: self.policy,
            s3fifo: S3FifoParams { small_ratio: self.s3fifo_small_ratio, max_freq: self.s3fifo_max_freq },
        }
    }

    /// A config for tests and embedded fleets: every socket on 127.0.0.1 port 0.
    pub fn loopback(name: impl Into<String>) -> Self {
        let any: SocketAddr = "127.0.0.1:0".parse().expect("valid address");
        Config {
            name: name.into(),
            http_addr: any,
            grpc_addr: any,
            events_endpoint: "tcp://127.0.0.1:0".into(),
            replay_endpoint: "tcp://127.0.0.1:0".into(),
            disaggregation_bootstrap_port: 0,
            ..Config::default()
        }
    }

    /// Every problem with the settings, or `Ok` if there is none.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut errors = Vec::new();
        let mut check = |ok: bool, msg: String| {
            if !ok {
                errors.push(msg);
            }
        };
        check(!self.name.is_empty(), "--name must not be empty".into());
        check(
            !self.api_key.as_ref().is_some_and(|key| key.is_empty() || key.contains(char::is_whitespace)),
            "--api-key must not be empty or hold whitespace (a newline at the end of its file?): no client could send it"
                .into(),
        );
        check(
            self.ssl_certfile.is_some() == self.ssl_keyfile.is_some()
                && (self.ssl_ca_certs.is_none() || self.ssl_certfile.is_some()),
            "--ssl-certfile and --ssl-keyfile go together (and --ssl-ca-certs with them)".into(),
        );
        if let Some(files) = self.tls_files()
            && let Err(e) = kvroute_proto::serve::Tls::from_files(&files)
        {
            check(false, format!("--ssl-certfile, --ssl-keyfile, --ssl-ca-certs: {e}"));
        }
        check(!self.model.is_empty(), "--model must not be empty".into());
        check(
            self.kv_transfer_config.is_none() || self.disaggregation_mode == DisaggregationMode::Null,
            "--kv-transfer-config (vLLM's disaggregation) and --disaggregation-mode (SGLang's) exclude each other"
                .into(),
        );
        for problem in self.chat.problems() {
            check(false, problem);
        }
        check(
            (1..=MAX_DATA_PARALLEL_SIZE).contains(&self.data_parallel_size),
            format!("--data-parallel-size must be between 1 and {MAX_DATA_PARALLEL_SIZE}"),
        );
        for (flag, endpoint) in
            [("--events-endpoint", &self.events_endpoint), ("--replay-endpoint", &self.replay_endpoint)]
        {
            let last = self.data_parallel_size.saturating_sub(1);
            check(
                endpoint.is_empty()
                    || !endpoint.contains("://")
                    || kvroute_proto::framing::rank_endpoint(endpoint, last).is_some(),
                format!(
                    "{flag} {endpoint:?} has no port for data-parallel rank {last} (port + rank past 65535, or not tcp:// or ipc://)"
                ),
            );
        }
        let n = u32::from(u16::try_from(self.data_parallel_size).unwrap_or(u16::MAX));
        if let (Some(events), Some(replay)) =
            (tcp_port(&self.events_endpoint), tcp_port(&self.replay_endpoint))
            && events != 0
            && replay != 0
        {
            let (e, r) = (u32::from(events), u32::from(replay));
            check(
                e + n <= r || r + n <= e,
                format!(
                    "--events-endpoint's ports {e}..={} and --replay-endpoint's {r}..={} overlap (rank r uses \
                     each one's port + r): put the replay endpoint {n} or more ports away",
                    e + n - 1,
                    r + n - 1
                ),
            );
        }
        check(self.block_size > 0, "--block-size must be at least 1".into());
        check(self.capacity_blocks > 0, "--capacity-blocks must be at least 1".into());
        check(
            self.s3fifo_small_ratio > 0.0 && self.s3fifo_small_ratio < 1.0,
            format!("--s3fifo-small-ratio must be in (0, 1), got {}", self.s3fifo_small_ratio),
        );
        if let Some(problem) = self.cache().capacity_problem() {
            let capacity = self.capacity_blocks;
            check(false, format!("--capacity-blocks {capacity} (--policy, --s3fifo-small-ratio): {problem}"));
        }
        check(self.max_model_len > 0, "--max-model-len must be at least 1".into());
        check(self.max_num_seqs > 0, "--max-num-seqs must be at least 1".into());
        check(self.default_max_tokens > 0, "--default-max-tokens must be at least 1".into());
        check(self.max_body_bytes > 0, "--max-body-bytes must be at least 1".into());
        check(
            self.max_num_batched_tokens >= self.block_size.max(1),
            format!(
                "--max-num-batched-tokens ({}) must be at least the block size ({})",
                self.max_num_batched_tokens, self.block_size
            ),
        );
        // As vLLM refuses it: a step whose decodes take the whole budget prefills nothing,
        // and new requests wait until enough sequences finish.
        check(
            self.max_num_batched_tokens >= self.max_num_seqs,
            format!(
                "--max-num-batched-tokens ({}) must be at least --max-num-seqs ({})",
                self.max_num_batched_tokens, self.max_num_seqs
            ),
        );
        // Beyond what a tokio semaphore or channel holds: refused here, not a panic at start.
        let most = tokio::sync::Semaphore::MAX_PERMITS;
        check(
            self.max_waiting > 0 && self.max_waiting <= most,
            format!("--max-waiting must be between 1 and {most}"),
        );
        check(
            self.max_connections > 0 && self.max_connections <= most,
            format!("--max-connections must be between 1 and {most}"),
        );
        check(self.body_timeout_ms > 0, "--body-timeout-ms must be at least 1".into());
        check(
            self.max_header_bytes >= MIN_HEADER_BYTES,
            format!("--max-header-bytes must be at least {MIN_HEADER_BYTES}"),
        );
        check(
            self.time_scale.is_finite() && self.time_scale > 0.0,
            format!("--time-scale must be a positive number, got {}", self.time_scale),
        );
        check(
            self.events_endpoint.contains("://"),
            format!("--events-endpoint {:?} is not a ZeroMQ endpoint", self.events_endpoint),
        );
        check(
            self.replay_endpoint.is_empty() || self.replay_endpoint.contains("://"),
            format!("--replay-endpoint {:?} is not a ZeroMQ endpoint", self.replay_endpoint),
        );
        if let Some(problem) = self
            .tokenizer
            .as_ref()
            .and_then(|p| kvroute_proto::openai::tokenizer_path_problem("--tokenizer", p))
        {
            check(false, problem);
        }
        if let Some(path) = &self.chat_template {
            check(path.is_file(), format!("--chat-template {} is not a readable file", path.display()));
        }
        check(
            !self.lora_adapters.iter().any(|a| a.trim().is_empty()),
            "--lora-adapters must not name an empty adapter".into(),
        );
        check(
            !self.lora_adapters.contains(&self.model),
            "--lora-adapters must not name the base model".into(),
        );
        if errors.is_empty() { Ok(()) } else { Err(errors) }
    }

    /// The step-time model these settings describe.
    pub fn timing(&self) -> TimingModel {
        TimingModel {
            step_base: Duration::from_micros(self.step_base_us),
            prefill_per_token: Duration::from_micros(self.prefill_us_per_token),
            decode_per_seq: Duration::from_micros(self.decode_us_per_seq),
            time_scale: self.time_scale,
        }
    }

    /// Limits of the HTTP server: its drain lasts the shutdown's grace (the engine fails what
    /// it still runs then) and some seconds more, for the answers to go out.
    pub fn serve_limits(&self) -> Limits {
        // A grace too long for the clock is a century (as the engine takes it).
        let grace = Duration::from_secs(self.shutdown_grace_secs.min(100 * 365 * 86_400));
        Limits {
            max_connections: self.max_connections,
            max_header_bytes: self.max_header_bytes,
            drain_timeout: Some(grace + kvroute_proto::serve::DEFAULT_DRAIN),
            ..Limits::default()
        }
    }

    /// The API's TLS files, if it serves HTTPS.
    pub fn tls_files(&self) -> Option<TlsFiles> {
        let (cert, key) = (self.ssl_certfile.clone()?, self.ssl_keyfile.clone()?);
        Some(TlsFiles { cert, key, client_ca: self.ssl_ca_certs.clone() })
    }

    /// The replay endpoint, if replay is enabled.
    pub fn replay(&self) -> Option<&str> {
        (!self.replay_endpoint.is_empty()).then_some(self.replay_endpoint.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(Config::default().validate(), Ok(()));
        assert_eq!(Config::loopback("a").validate(), Ok(()));
    }

    #[test]
    fn one_way_to_disaggregate_at_a_time() {
        let nixl = crate::kv_transfer::KvTransferConfig::parse(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both"}"#,
        );
        let both = Config {
            kv_transfer_config: Some(nixl.unwrap()),
            disaggregation_mode: DisaggregationMode::Decode,
            ..Config::loopback("a")
        };
        let errors = both.validate().unwrap_err();
        assert!(errors.iter().any(|e| e.contains("--disaggregation-mode")), "{errors:?}");
        let sglang = Config { disaggregation_mode: DisaggregationMode::Prefill, ..Config::loopback("a") };
        assert_eq!(sglang.validate(), Ok(()));
    }

    #[test]
    fn every_problem_is_reported_at_once() {
        let c = Config {
            block_size: 0,
            capacity_blocks: 0,
            time_scale: -1.0,
            s3fifo_small_ratio: 1.5,
            events_endpoint: "nowhere".into(),
            tokenizer: Some("/nonexistent/tokenizer.json".into()),
            ..Config::default()
        };
        let errors = c.validate().unwrap_err();
        assert_eq!(errors.len(), 6, "{errors:#?}");
        // Values that would refuse every request (413 for every body; max_tokens 0 for every
        // completion that sets none) are refused here instead.
        let c = Config { max_body_bytes: 0, default_max_tokens: 0, ..Config::default() };
        assert_eq!(c.validate().unwrap_err().len(), 2);
    }

    /// Values that parse but that a semaphore, a channel or a model list cannot take are
    /// refused here, not a panic (or a model named "") once running.
    #[test]
    fn limits_past_what_the_server_holds_and_empty_adapters_are_refused() {
        let c = Config {
            max_waiting: usize::MAX,
            max_connections: usize::MAX,
            lora_adapters: vec!["sql".into(), String::new()],
            ..Config::default()
        };
        assert_eq!(c.validate().unwrap_err().len(), 3);
    }

    /// A cache its policy cannot run with, an API key no client can send, TLS files that cannot
    /// be served, and a step budget
    /// the running sequences' decodes can take whole are refused up front with the flags named (not when the engine starts, or as a 401 to every request).
    #[test]
    fn a_cache_that_cannot_run_and_an_unsendable_key_are_refused() {
        use crate::cache::PolicyKind;
        let cases = [
            (
                Config { policy: PolicyKind::S3fifo, capacity_blocks: 5, ..Config::default() },
                "--capacity-blocks 5",
            ),
            (Config { capacity_blocks: 3_000_000_000, ..Config::default() }, "--capacity-blocks 3000000000"),
            (Config { api_key: Some("k\n".into()), ..Config::default() }, "--api-key"),
            (Config { api_key: Some(String::new()), ..Config::default() }, "--api-key"),
            (
                Config {
                    ssl_certfile: Some("/nonexistent/cert.pem".into()),
                    ssl_keyfile: Some("/nonexistent/key.pem".into()),
                    ..Config::default()
                },
                "/nonexistent/cert.pem",
            ),
            (
                Config { ssl_certfile: Some("cert.pem".into()), ..Config::default() },
                "--ssl-keyfile go together",
            ),
            (
                Config { max_num_seqs: 256, max_num_batched_tokens: 64, block_size: 16, ..Config::default() },
                "--max-num-seqs (256)",
            ),
        ];
        for (config, flag) in cases {
            let errors = config.validate().unwrap_err();
            assert!(errors.len() == 1 && errors[0].contains(flag), "{flag}: {errors:?}");
        }
        let fits = Config { policy: PolicyKind::S3fifo, capacity_blocks: 20, ..Config::default() };
        assert_eq!(fits.validate(), Ok(()));
    }

    #[test]
    fn data_parallel_ranks_need_a_port_each() {
        let ranks = |n: u32, events: &str| Config {
            data_parallel_size: n,
            events_endpoint: events.into(),
            replay_endpoint: String::new(),
            ..Config::default()
        };
        assert_eq!(ranks(4, "tcp://127.0.0.1:5557").validate(), Ok(()));
        assert_eq!(ranks(4, "ipc:///tmp/kv").validate(), Ok(()));
        assert_eq!(ranks(2, "tcp://127.0.0.1:0").validate(), Ok(()));
        assert_eq!(ranks(1, "tcp://127.0.0.1:65535").validate(), Ok(()));
        let past = ranks(2, "tcp://127.0.0.1:65535").validate().unwrap_err();
        assert!(past[0].contains("--events-endpoint") && past[0].contains("rank 1"), "{past:?}");
        assert_eq!(ranks(0, "tcp://127.0.0.1:5557").validate().unwrap_err().len(), 1);
        // The default endpoints (events 5557, replay 5558) leave room for one rank only.
        let defaults = Config { data_parallel_size: 2, ..Config::default() };
        let overlap = defaults.validate().unwrap_err();
        assert!(overlap[0].contains("5557..=5558") && overlap[0].contains("5558..=5559"), "{overlap:?}");
        let apart = Config { replay_endpoint: "tcp://127.0.0.1:5600".into(), ..defaults };
        assert_eq!(apart.validate(), Ok(()));
        assert_eq!(
            ranks(MAX_DATA_PARALLEL_SIZE + 1, "tcp://127.0.0.1:5557").validate().unwrap_err().len(),
            1
        );
    }

    /// Regression: clap's `requires` checked the TLS flags before the file was read, so a
    /// file naming the certificate and key, with `--ssl-ca-certs` on the command line, was
    /// refused for want of `--ssl-certfile`. `validate` checks the pairing, merged.
    #[test]
    fn tls_files_from_the_file_go_with_a_flag() {
        let dir = std::env::temp_dir().join(format!("kvroute-agent-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("agent.toml");
        std::fs::write(&file, "ssl-certfile = \"/tls/tls.crt\"\nssl-keyfile = \"/tls/tls.key\"\n").unwrap();
        let parsed = kvroute_proto::cli::parse_from::<Config, _, _>([
            "kvroute-agent".as_ref(),
            "--config".as_ref(),
            file.as_os_str(),
            "--ssl-ca-certs".as_ref(),
            "/tls/ca.crt".as_ref(),
        ]);
        std::fs::remove_dir_all(&dir).unwrap();
        let c = parsed.unwrap();
        assert_eq!(c.ssl_certfile.as_deref(), Some(Path::new("/tls/tls.crt")));
        assert_eq!(c.ssl_ca_certs.as_deref(), Some(Path::new("/tls/ca.crt")));
        let alone = Config { ssl_ca_certs: Some("/tls/ca.crt".into()), ..Config::default() };
        assert!(alone.validate().unwrap_err().iter().any(|e| e.contains("--ssl-certfile")));
    }

    #[test]
    fn flags_parse_with_enums() {
        let c = kvroute_proto::cli::parse_from::<Config, _, _>([
            "kvroute-agent",
            "--policy",
            "s3fifo",
            "--event-format",
            "vllm",
            "--lora-adapters",
            "a,b",
        ])
        .unwrap();
        assert_eq!(c.policy, PolicyKind::S3fifo);
        assert_eq!(c.event_format, EventFormat::Vllm);
        assert_eq!(c.lora_adapters, vec!["a".to_string(), "b".to_string()]);
        assert!(
            kvroute_proto::cli::parse_from::<Config, _, _>(["kvroute-agent", "--policy", "fifo"]).is_err()
        );
    }
}
