//! serde `Serialize` impls writing vLLM 0.33's shapes: the batch as an array
//! `[ts, events, dp_rank]`, events as maps keyed like msgspec's structs (`"type"` first, then
//! declaration order), optional fields that vLLM declares with a default omitted when `None`
//! (msgspec `omit_defaults=True`), fields without a default always written, even as nil.

use serde::ser::{Serialize, SerializeMap, SerializeSeq, SerializeTuple, Serializer};

use super::{BlockRemoved, BlockStored, ExtraKey, VllmBatch, VllmEvent};

impl Serialize for VllmBatch {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(3)?;
        t.serialize_element(&self.ts)?;
        t.serialize_element(&self.events)?;
        t.serialize_element(&self.dp_rank)?;
        t.end()
    }
}

/// Counts the `Some`s among optional fields.
fn present(fields: &[bool]) -> usize {
    fields.iter().filter(|p| **p).count()
}

/// Writes `key: value` only when `value` is `Some`.
fn entry_if<M: SerializeMap, T: Serialize>(m: &mut M, key: &str, value: &Option<T>) -> Result<(), M::Error> {
    match value {
        Some(v) => m.serialize_entry(key, v),
        None => Ok(()),
    }
}

impl Serialize for VllmEvent {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            VllmEvent::BlockStored(e) => e.serialize(s),
            VllmEvent::BlockRemoved(e) => e.serialize(s),
            VllmEvent::AllBlocksCleared => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("type", "AllBlocksCleared")?;
                m.end()
            }
            VllmEvent::Unknown(tag) => {
                let mut m = s.serialize_map(Some(1))?;
                m.serialize_entry("type", tag)?;
                m.end()
            }
            VllmEvent::Malformed(_) => s.serialize_unit(),
        }
    }
}

impl Serialize for BlockStored {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let optional = present(&[
            self.extra_keys.is_some(),
            self.group_idx.is_some(),
            self.kv_cache_spec_kind.is_some(),
            self.kv_cache_spec_sliding_window.is_some(),
            self.locality.is_some(),
            self.ownership.is_some(),
            self.session_id.is_some(),
            self.lookahead_token_ids.is_some(),
            self.cache_salt.is_some(),
            self.origin.is_some(),
        ]);
        let mut m = s.serialize_map(Some(8 + optional))?;
        m.serialize_entry("type", "BlockStored")?;
        m.serialize_entry("block_hashes", &self.block_hashes)?;
        m.serialize_entry("parent_block_hash", &self.parent_block_hash)?;
        m.serialize_entry("token_ids", &self.token_ids)?;
        m.serialize_entry("block_size", &self.block_size)?;
        m.serialize_entry("lora_id", &self.lora_id)?;
        m.serialize_entry("medium", &self.medium)?;
        m.serialize_entry("lora_name", &self.lora_name)?;
        entry_if(&mut m, "extra_keys", &self.extra_keys)?;
        entry_if(&mut m, "group_idx", &self.group_idx)?;
        entry_if(&mut m, "kv_cache_spec_kind", &self.kv_cache_spec_kind)?;
        entry_if(&mut m, "kv_cache_spec_sliding_window", &self.kv_cache_spec_sliding_window)?;
        entry_if(&mut m, "locality", &self.locality)?;
        entry_if(&mut m, "ownership", &self.ownership)?;
        entry_if(&mut m, "session_id", &self.session_id)?;
        entry_if(&mut m, "lookahead_token_ids", &self.lookahead_token_ids)?;
        // Not a vLLM field (SGLang's); msgspec ignores unknown keys, so it is safe to send.
        entry_if(&mut m, "cache_salt", &self.cache_salt)?;
        entry_if(&mut m, "origin", &self.origin)?;
        m.end()
    }
}

impl Serialize for BlockRemoved {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let optional =
            present(&[self.group_idx.is_some(), self.locality.is_some(), self.ownership.is_some()]);
        let mut m = s.serialize_map(Some(3 + optional))?;
        m.serialize_entry("type", "BlockRemoved")?;
        m.serialize_entry("block_hashes", &self.block_hashes)?;
        m.serialize_entry("medium", &self.medium)?;
        entry_if(&mut m, "group_idx", &self.group_idx)?;
        entry_if(&mut m, "locality", &self.locality)?;
        entry_if(&mut m, "ownership", &self.ownership)?;
        m.end()
    }
}

impl Serialize for ExtraKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ExtraKey::Nil | ExtraKey::Other => s.serialize_none(),
            ExtraKey::Bool(v) => s.serialize_bool(*v),
            ExtraKey::Int(v) => s.serialize_i64(*v),
            ExtraKey::UInt(v) => s.serialize_u64(*v),
            ExtraKey::Float(v) => s.serialize_f64(*v),
            ExtraKey::Str(v) => s.serialize_str(v),
            ExtraKey::Bytes(v) => s.serialize_bytes(v),
            ExtraKey::Tuple(items) => {
                let mut seq = s.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
        }
    }
}
