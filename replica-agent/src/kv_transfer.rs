//! Disaggregated prefill as vLLM's NixlConnector plays it over HTTP, so a router can split a
//! request between a prefill replica (P) and a decode replica (D) in front of agents as in
//! front of vLLM (`--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'`).
//!
//! 1. The router sends P the request with `max_tokens` 1, no stream, and
//!    `"kv_transfer_params": {"do_remote_decode": true, ...}`.
//! 2. P runs the prefill (its prefix cache and events as for any request) and answers with a
//!    top-level `kv_transfer_params`: `do_remote_prefill` true, `remote_engine_id`,
//!    `remote_request_id`, `remote_block_ids` (one per block of the prompt, the last partial
//!    one too), `remote_host`, `remote_port` (vLLM's side channel, port + rank) and `tp_size`.
//! 3. The router sends D the client's request with those params. D takes what its own prefix
//!    cache holds, pulls the rest of the prompt but its last token from P, recomputes that
//!    token and decodes. The pulled tokens count as cached (vLLM's D reports
//!    `cached_tokens` = prompt tokens − 1) and as external prefix-cache hits; each costs
//!    [`crate::engine::LOAD_SHARE`] of a prefill token, as a load from host memory does. D
//!    caches the prompt's full blocks and publishes them, as vLLM's does once the pull ends.
//!
//! Params missing a key D needs are ignored with a warning, as vLLM ignores them: D then
//! prefills the prompt itself. An agent without a connector ignores `kv_transfer_params`.
//!
//! Not modelled: the transfer itself (no bytes move, so P's block ids are its blocks'
//! places in the prompt, not in its cache), P holding the blocks until D has read them, and
//! requests of several prompts or choices (P answers them without params; D prefills them).

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// `--kv-transfer-config`: the keys of vLLM's `KVTransferConfig` the agent reads (others are
/// accepted and ignored).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvTransferConfig {
    /// Only `NixlConnector` is played.
    pub kv_connector: String,
    /// `kv_producer` (prefills for others), `kv_consumer` (decodes what others prefilled) or
    /// `kv_both`.
    pub kv_role: KvRole,
    /// Named in P's params (vLLM's default is a random UUID; here the replica's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine_id: Option<String>,
}

/// `kv_role`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvRole {
    KvProducer,
    KvConsumer,
    KvBoth,
}

/// The connector this agent plays.
pub const NIXL: &str = "NixlConnector";

/// vLLM's default side-channel port (`VLLM_NIXL_SIDE_CHANNEL_PORT`); rank r answers on + r.
pub const SIDE_CHANNEL_PORT: u16 = 5600;

impl KvTransferConfig {
    /// Parses the flag's JSON, as vLLM's `--kv-transfer-config` takes it.
    pub fn parse(json: &str) -> Result<Self, String> {
        let config: KvTransferConfig =
            serde_json::from_str(json).map_err(|e| format!("--kv-transfer-config: {e}"))?;
        if config.kv_connector != NIXL {
            return Err(format!(
                "--kv-transfer-config: kv_connector {:?} is not simulated; only {NIXL:?} is",
                config.kv_connector
            ));
        }
        Ok(config)
    }

    fn prefills(&self) -> bool {
        self.kv_role != KvRole::KvConsumer
    }

    fn decodes(&self) -> bool {
        self.kv_role != KvRole::KvProducer
    }
}

/// What a request's `kv_transfer_params` ask of this agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Asked {
    /// Nothing (absent, null, or no connector here to do it).
    #[default]
    Nothing,
    /// Prefill for a remote decode: answer with params naming the prompt's blocks.
    RemoteDecode,
    /// Decode after a remote prefill of `blocks` blocks of the prompt.
    RemotePrefill { blocks: usize },
}

/// The keys D needs to pull (vLLM's NixlConnector warns and pulls nothing without them).
const PULL_KEYS: [&str; 5] =
    ["remote_engine_id", "remote_request_id", "remote_host", "remote_port", "remote_block_ids"];

/// Reads `kv_transfer_params` (a repeated key's last value). `Err`: it is not an object.
pub fn asked(raw: Option<&RawValue>, config: Option<&KvTransferConfig>) -> Result<Asked, String> {
    let Some(raw) = raw.filter(|raw| raw.get() != "null") else { return Ok(Asked::Nothing) };
    let params: serde_json::Map<String, Value> =
        serde_json::from_str(raw.get()).map_err(|_| "kv_transfer_params must be an object".to_owned())?;
    let Some(config) = config else { return Ok(Asked::Nothing) };
    let flag = |key: &str| params.get(key).and_then(Value::as_bool).unwrap_or(false);
    if flag("do_remote_decode") && config.prefills() {
        return Ok(Asked::RemoteDecode);
    }
    if !flag("do_remote_prefill") || !config.decodes() {
        return Ok(Asked::Nothing);
    }
    match (
        PULL_KEYS.iter().find(|key| params.get(**key).is_none_or(Value::is_null)),
        params.get("remote_block_ids"),
    ) {
        (None, Some(Value::Array(blocks))) => Ok(Asked::RemotePrefill { blocks: blocks.len() }),
        (missing, _) => {
            let missing = missing.copied().unwrap_or("remote_block_ids");
            tracing::warn!(
                missing,
                "kv_transfer_params asks for a remote prefill without all it needs; prefilling here"
            );
            Ok(Asked::Nothing)
        }
    }
}

/// The prompt tokens D pulls after a remote prefill of `blocks` blocks: all but the last
/// prompt token, as far as the blocks reach.
pub fn pulled_tokens(blocks: usize, block_size: usize, prompt_tokens: usize) -> usize {
    blocks.saturating_mul(block_size).min(prompt_tokens.saturating_sub(1))
}

/// P's answer to a remote decode's prefill of `prompt_tokens`, on data-parallel rank `rank`.
pub fn produced(
    config: &KvTransferConfig,
    replica: &str,
    request_id: &str,
    (prompt_tokens, block_size): (usize, usize),
    rank: u32,
) -> Value {
    let blocks: Vec<usize> = (0..prompt_tokens.div_ceil(block_size.max(1))).collect();
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": blocks,
        "remote_engine_id": config.engine_id.as_deref().unwrap_or(replica),
        "remote_request_id": request_id,
        "remote_host": "localhost",
        "remote_port": u32::from(SIDE_CHANNEL_PORT) + rank,
        "tp_size": 1,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(json: &str) -> Box<RawValue> {
        RawValue::from_string(json.to_owned()).unwrap()
    }

    fn config(role: KvRole) -> KvTransferConfig {
        KvTransferConfig { kv_connector: NIXL.into(), kv_role: role, engine_id: None }
    }

    #[test]
    fn the_flag_takes_vllms_json_and_refuses_other_connectors() {
        let parsed = KvTransferConfig::parse(
            r#"{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cuda"}"#,
        );
        assert_eq!(parsed, Ok(config(KvRole::KvBoth)));
        let other = KvTransferConfig::parse(r#"{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}"#);
        assert!(other.unwrap_err().contains("LMCacheConnectorV1"));
        let role = KvTransferConfig::parse(r#"{"kv_connector":"NixlConnector","kv_role":"both"}"#);
        assert!(role.unwrap_err().contains("unknown variant `both`"));
        assert!(KvTransferConfig::parse("{").is_err());
    }

    #[test]
    fn params_are_read_by_role() {
        let decode = raw(r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null}"#);
        let both = config(KvRole::KvBoth);
        assert_eq!(asked(Some(&decode), Some(&both)), Ok(Asked::RemoteDecode));
        assert_eq!(asked(Some(&decode), Some(&config(KvRole::KvConsumer))), Ok(Asked::Nothing));
        assert_eq!(asked(Some(&decode), None), Ok(Asked::Nothing));
        let prefilled = produced(&both, "p-0", "req-1", (40, 16), 1);
        assert_eq!(prefilled["remote_port"], 5601);
        let prefilled = raw(&prefilled.to_string());
        assert_eq!(asked(Some(&prefilled), Some(&both)), Ok(Asked::RemotePrefill { blocks: 3 }));
        assert_eq!(asked(Some(&prefilled), Some(&config(KvRole::KvProducer))), Ok(Asked::Nothing));
        assert_eq!(asked(Some(&raw("null")), Some(&both)), Ok(Asked::Nothing));
        assert!(asked(Some(&raw("[1]")), Some(&both)).is_err());
    }

    #[test]
    fn params_missing_what_a_pull_needs_pull_nothing() {
        let both = config(KvRole::KvBoth);
        let mut full = produced(&both, "p-0", "req-1", (40, 16), 0);
        for key in PULL_KEYS {
            let mut partial = full.clone();
            partial[key] = Value::Null;
            assert_eq!(asked(Some(&raw(&partial.to_string())), Some(&both)), Ok(Asked::Nothing), "{key}");
            // Left out, not null: as absent.
            partial.as_object_mut().unwrap().remove(key);
            assert_eq!(asked(Some(&raw(&partial.to_string())), Some(&both)), Ok(Asked::Nothing), "{key}");
        }
        full["remote_block_ids"] = json!("0,1");
        assert_eq!(asked(Some(&raw(&full.to_string())), Some(&both)), Ok(Asked::Nothing));
    }

    #[test]
    fn the_pull_stops_before_the_last_prompt_token() {
        assert_eq!(pulled_tokens(3, 16, 40), 39);
        assert_eq!(pulled_tokens(2, 16, 40), 32);
        assert_eq!(pulled_tokens(0, 16, 40), 0);
        assert_eq!(pulled_tokens(5, 16, 0), 0);
    }
}
