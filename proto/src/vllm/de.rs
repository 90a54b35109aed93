//! Hand-written serde `Deserialize` impls for the vLLM / SGLang event shapes: every value is
//! read with `deserialize_any`, so one visitor accepts both the map and the positional form.
//! Visitors always drain what they do not use: rmp-serde rejects a partly read array or map.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::{BlockRemoved, BlockStored, ExtraKey, MAX_EVENTS, MAX_PREALLOC, VllmBatch, VllmEvent};
use crate::BlockHash;

/// A vector with room for the declared length, but never more than [`MAX_PREALLOC`].
fn capped<T>(size_hint: Option<usize>) -> Vec<T> {
    Vec::with_capacity(size_hint.unwrap_or(0).min(MAX_PREALLOC))
}

thread_local! {
    /// Bytes the lists of the payload being decoded may still take ([`with_budget`]).
    static BUDGET: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
}

/// Runs `decode` allowing its lists `bytes` of memory in all: a one-byte nil or fixint on the
/// wire takes up to 32 bytes decoded, so a message the ZMTP guard lets through (64 MiB) could
/// otherwise ask for gigabytes.
pub(super) fn with_budget<T>(bytes: usize, decode: impl FnOnce() -> T) -> T {
    let before = BUDGET.replace(bytes);
    let out = decode();
    BUDGET.set(before);
    out
}

/// Takes the room of one more `T` (an element, or a list's own header) from the budget.
fn charge<T, E: de::Error>() -> Result<(), E> {
    BUDGET.with(|left| match left.get().checked_sub(std::mem::size_of::<T>()) {
        Some(rest) => {
            left.set(rest);
            Ok(())
        }
        None => Err(E::custom("the batch decodes to far more memory than its size")),
    })
}

/// The elements of `seq`, each charged to the budget, as is the list itself.
fn list<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(mut seq: A) -> Result<Vec<T>, A::Error> {
    charge::<Vec<T>, A::Error>()?;
    let mut out = capped(seq.size_hint());
    while let Some(item) = seq.next_element()? {
        charge::<T, A::Error>()?;
        out.push(item);
    }
    Ok(out)
}

fn drain_seq<'de, A: SeqAccess<'de>>(seq: &mut A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

fn drain_map<'de, A: MapAccess<'de>>(map: &mut A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

/// A required positional element.
fn required<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(
    seq: &mut A,
    index: usize,
    what: &'static str,
) -> Result<T, A::Error> {
    seq.next_element()?.ok_or_else(|| de::Error::invalid_length(index, &what))
}

/// An optional positional element: absent (older layout) or nil both read as `None`.
fn optional<'de, A: SeqAccess<'de>, T: Deserialize<'de>>(seq: &mut A) -> Result<Option<T>, A::Error> {
    Ok(seq.next_element::<Option<T>>()?.flatten())
}

// ---------------------------------------------------------------------------------------
// Hashes

/// One block hash in any of its wire forms.
struct WireHash(BlockHash);

impl<'de> Deserialize<'de> for WireHash {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = WireHash;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a block hash (uint, int or bin)")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<WireHash, E> {
                Ok(WireHash(BlockHash(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<WireHash, E> {
                Ok(WireHash(BlockHash(v as u64)))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<WireHash, E> {
                Ok(WireHash(super::block_hash_from_digest(v)))
            }
        }
        d.deserialize_any(V)
    }
}

struct Hashes(Vec<BlockHash>);

impl<'de> Deserialize<'de> for Hashes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Hashes;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of block hashes")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Hashes, A::Error> {
                let hashes: Vec<WireHash> = list(seq)?;
                Ok(Hashes(hashes.into_iter().map(|h| h.0).collect()))
            }
        }
        d.deserialize_any(V)
    }
}

/// Token ids: an array of uints that fit in 32 bits.
struct Tokens(Vec<u32>);

impl<'de> Deserialize<'de> for Tokens {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Tokens;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of token ids")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Tokens, A::Error> {
                Ok(Tokens(list(seq)?))
            }
        }
        d.deserialize_any(V)
    }
}

// ---------------------------------------------------------------------------------------
// Batch

/// `ts`: msgspec writes a float64; accept any number.
pub(super) struct Timestamp(pub f64);

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Timestamp;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a timestamp number")
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Timestamp, E> {
                Ok(Timestamp(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Timestamp, E> {
                Ok(Timestamp(v as f64))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Timestamp, E> {
                Ok(Timestamp(v as f64))
            }
        }
        d.deserialize_any(V)
    }
}

struct Events(Vec<VllmEvent>);

impl<'de> Deserialize<'de> for Events {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Events;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of events")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Events, A::Error> {
                let mut out = capped(seq.size_hint());
                while let Some(event) = seq.next_element()? {
                    if out.len() == MAX_EVENTS {
                        return Err(de::Error::custom(format!("more than {MAX_EVENTS} events in a batch")));
                    }
                    out.push(event);
                }
                Ok(Events(out))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for VllmBatch {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(BatchVisitor)
    }
}

struct BatchVisitor;

impl<'de> Visitor<'de> for BatchVisitor {
    type Value = VllmBatch;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a KVEventBatch array [ts, events, dp_rank?, ..]")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<VllmBatch, A::Error> {
        let Timestamp(ts) = required(&mut seq, 0, "a batch of at least [ts, events]")?;
        let Events(events) = required(&mut seq, 1, "a batch of at least [ts, events]")?;
        let dp_rank = optional(&mut seq)?;
        drain_seq(&mut seq)?;
        Ok(VllmBatch { ts, events, dp_rank })
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<VllmBatch, A::Error> {
        let (mut ts, mut events, mut dp_rank) = (None, None, None);
        while let Some(key) = map.next_key::<Key>()? {
            match key.as_str() {
                Some("ts") => ts = Some(map.next_value::<Timestamp>()?.0),
                // A second `events` would hide the first one's events.
                Some("events") if events.is_some() => return Err(de::Error::duplicate_field("events")),
                Some("events") => events = Some(map.next_value::<Events>()?.0),
                Some("data_parallel_rank" | "dp_rank" | "attn_dp_rank") => {
                    dp_rank = map.next_value::<Option<u32>>()?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(VllmBatch {
            ts: ts.ok_or_else(|| de::Error::missing_field("ts"))?,
            events: events.ok_or_else(|| de::Error::missing_field("events"))?,
            dp_rank,
        })
    }
}

// ---------------------------------------------------------------------------------------
// Map keys

/// A map key: a string (borrowed from the payload) or anything else, which is skipped.
enum Key<'de> {
    Name(&'de str),
    Owned(String),
    Other,
}

impl<'de> Key<'de> {
    fn as_str(&self) -> Option<&str> {
        match self {
            Key::Name(s) => Some(s),
            Key::Owned(s) => Some(s),
            Key::Other => None,
        }
    }
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a map key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key::Name(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key::Owned(v.to_owned()))
            }
            fn visit_borrowed_bytes<E: de::Error>(self, v: &'de [u8]) -> Result<Key<'de>, E> {
                Ok(std::str::from_utf8(v).map_or(Key::Other, Key::Name))
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Key<'de>, E> {
                Ok(std::str::from_utf8(v).map_or(Key::Other, |s| Key::Owned(s.to_owned())))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Key<'de>, E> {
                Ok(Key::Other)
            }
            fn visit_i64<E: de::Error>(self, _: i64) -> Result<Key<'de>, E> {
                Ok(Key::Other)
            }
            fn visit_u64<E: de::Error>(self, _: u64) -> Result<Key<'de>, E> {
                Ok(Key::Other)
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Key<'de>, E> {
                Ok(Key::Other)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Key<'de>, E> {
                Ok(Key::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Key<'de>, A::Error> {
                drain_seq(&mut seq)?;
                Ok(Key::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Key<'de>, A::Error> {
                drain_map(&mut map)?;
                Ok(Key::Other)
            }
        }
        d.deserialize_any(V)
    }
}

// ---------------------------------------------------------------------------------------
// Events

impl<'de> Deserialize<'de> for VllmEvent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(EventVisitor)
    }
}

const BLOCK_STORED: &str = "BlockStored";
const BLOCK_REMOVED: &str = "BlockRemoved";
const ALL_BLOCKS_CLEARED: &str = "AllBlocksCleared";

struct EventVisitor;

impl<'de> Visitor<'de> for EventVisitor {
    type Value = VllmEvent;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a tagged event (map with \"type\", or array with the tag first)")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<VllmEvent, A::Error> {
        let tag: String = required(&mut seq, 0, "an event tag")?;
        let event = match tag.as_str() {
            BLOCK_STORED => {
                const WHAT: &str = "BlockStored with block_hashes, parent, token_ids, block_size";
                let Hashes(block_hashes) = required(&mut seq, 1, WHAT)?;
                let parent_block_hash = required::<_, Option<WireHash>>(&mut seq, 2, WHAT)?.map(|h| h.0);
                let Tokens(token_ids) = required(&mut seq, 3, WHAT)?;
                let block_size = required(&mut seq, 4, WHAT)?;
                VllmEvent::BlockStored(BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                    lora_id: optional(&mut seq)?,
                    medium: optional(&mut seq)?,
                    lora_name: optional(&mut seq)?,
                    extra_keys: optional::<_, ExtraKeys>(&mut seq)?.map(|k| k.0),
                    group_idx: optional(&mut seq)?,
                    kv_cache_spec_kind: optional(&mut seq)?,
                    kv_cache_spec_sliding_window: optional(&mut seq)?,
                    ..BlockStored::default()
                })
            }
            BLOCK_REMOVED => {
                let Hashes(block_hashes) = required(&mut seq, 1, "BlockRemoved with block_hashes")?;
                VllmEvent::BlockRemoved(BlockRemoved {
                    block_hashes,
                    medium: optional(&mut seq)?,
                    group_idx: optional(&mut seq)?,
                    ..BlockRemoved::default()
                })
            }
            ALL_BLOCKS_CLEARED => VllmEvent::AllBlocksCleared,
            _ => VllmEvent::Unknown(tag),
        };
        drain_seq(&mut seq)?;
        Ok(event)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<VllmEvent, A::Error> {
        let mut tag: Option<String> = None;
        let mut f = MapFields::default();
        while let Some(key) = map.next_key::<Key>()? {
            let Some(name) = key.as_str() else {
                map.next_value::<IgnoredAny>()?;
                continue;
            };
            // Once the tag is known (msgspec writes it first), a key its event does not have is
            // skipped unread, whatever its value: another event's field of the same name (a
            // removal's `token_ids: nil`) does not make the event malformed.
            if tag.as_deref().is_some_and(|t| name != "type" && !has_field(t, name)) {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            match name {
                "type" => {
                    let t: String = map.next_value()?;
                    if ![BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED].contains(&t.as_str()) {
                        // msgspec writes the tag first: an unknown event's fields are never typed.
                        drain_map(&mut map)?;
                        return Ok(VllmEvent::Unknown(t));
                    }
                    tag = Some(t);
                }
                "block_hashes" => f.block_hashes = Some(map.next_value::<Hashes>()?.0),
                "parent_block_hash" => f.parent = map.next_value::<Option<WireHash>>()?.map(|h| h.0),
                "token_ids" => f.token_ids = Some(map.next_value::<Tokens>()?.0),
                "block_size" => f.block_size = Some(map.next_value()?),
                "lora_id" => f.s.lora_id = map.next_value()?,
                "medium" => f.s.medium = map.next_value()?,
                "lora_name" => f.s.lora_name = map.next_value()?,
                "extra_keys" => f.s.extra_keys = map.next_value::<Option<ExtraKeys>>()?.map(|k| k.0),
                "group_idx" => f.s.group_idx = map.next_value()?,
                "kv_cache_spec_kind" => f.s.kv_cache_spec_kind = map.next_value()?,
                "kv_cache_spec_sliding_window" => f.s.kv_cache_spec_sliding_window = map.next_value()?,
                "locality" => f.s.locality = map.next_value()?,
                "ownership" => f.s.ownership = map.next_value()?,
                "session_id" => f.s.session_id = map.next_value()?,
                "lookahead_token_ids" => {
                    f.s.lookahead_token_ids = map
                        .next_value::<Option<Vec<Tokens>>>()?
                        .map(|rows| rows.into_iter().map(|t| t.0).collect());
                }
                "cache_salt" => f.s.cache_salt = map.next_value()?,
                "origin" => f.s.origin = map.next_value()?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let tag = tag.ok_or_else(|| de::Error::missing_field("type"))?;
        let hashes = f.block_hashes.ok_or_else(|| de::Error::missing_field("block_hashes"));
        Ok(match tag.as_str() {
            BLOCK_STORED => VllmEvent::BlockStored(BlockStored {
                block_hashes: hashes?,
                parent_block_hash: f.parent,
                token_ids: f.token_ids.ok_or_else(|| de::Error::missing_field("token_ids"))?,
                block_size: f.block_size.ok_or_else(|| de::Error::missing_field("block_size"))?,
                ..f.s
            }),
            BLOCK_REMOVED => VllmEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes?,
                medium: f.s.medium,
                group_idx: f.s.group_idx,
                locality: f.s.locality,
                ownership: f.s.ownership,
            }),
            _ => VllmEvent::AllBlocksCleared,
        })
    }
}

/// Whether an event tagged `tag` has a field `name` (a `BlockStored` reads every field it
/// knows; an `AllBlocksCleared`, none). Fields that come before the tag are read as their name
/// says, whatever the event turns out to be.
fn has_field(tag: &str, name: &str) -> bool {
    match tag {
        BLOCK_STORED => true,
        BLOCK_REMOVED => ["block_hashes", "medium", "group_idx", "locality", "ownership"].contains(&name),
        _ => false,
    }
}

/// Map-form fields, collected in whatever order they come; `s` holds the optional ones.
#[derive(Default)]
struct MapFields {
    block_hashes: Option<Vec<BlockHash>>,
    parent: Option<BlockHash>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    s: BlockStored,
}

// ---------------------------------------------------------------------------------------
// Extra keys

struct ExtraKeys(Vec<ExtraKey>);

impl<'de> Deserialize<'de> for ExtraKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match ExtraKey::deserialize(d)? {
            ExtraKey::Tuple(keys) => Ok(ExtraKeys(keys)),
            _ => Err(de::Error::custom("extra_keys must be an array")),
        }
    }
}

impl<'de> Deserialize<'de> for ExtraKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ExtraKeyVisitor)
    }
}

struct ExtraKeyVisitor;

impl<'de> Visitor<'de> for ExtraKeyVisitor {
    type Value = ExtraKey;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an extra-key value")
    }
    fn visit_unit<E: de::Error>(self) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Nil)
    }
    fn visit_none<E: de::Error>(self) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Nil)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<ExtraKey, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<ExtraKey, E> {
        Ok(if v < 0 { ExtraKey::Int(v) } else { ExtraKey::UInt(v as u64) })
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<ExtraKey, E> {
        Ok(ExtraKey::UInt(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Str(v.to_owned()))
    }
    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<ExtraKey, E> {
        Ok(ExtraKey::Bytes(v.to_vec()))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<ExtraKey, A::Error> {
        Ok(ExtraKey::Tuple(list(seq)?))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ExtraKey, A::Error> {
        drain_map(&mut map)?;
        Ok(ExtraKey::Other)
    }
}
