//! A batch read event by event, for when it does not decode as a whole ([`decode`]): each
//! event's bytes are found first ([`value_len`], which reads lengths and allocates nothing),
//! then decoded on their own, so one that does not decode is a [`VllmEvent::Malformed`] and
//! the rest of its batch stands. What surrounds the events must be right, as in the strict
//! pass: `[ts, events, dp_rank?, ..]` or a map with `ts` and one `events`, and nothing after.

use rmp::Marker;
use serde::Deserialize;

use super::de::Timestamp;
use super::{MAX_DEPTH, MalformedEvent, VllmBatch, VllmEvent};

/// `payload` as a batch whose events are decoded one at a time; `None` when the batch
/// itself is not right.
pub(super) fn decode(payload: &[u8]) -> Option<VllmBatch> {
    let mut rd = payload;
    let (mut ts, mut events, mut dp_rank) = (None, None, None);
    match Marker::from_u8(*rd.first()?) {
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            let n = rmp::decode::read_array_len(&mut rd).ok()?;
            if n < 2 {
                return None;
            }
            ts = Some(value::<Timestamp>(&mut rd)?.0);
            events = Some(events_of(&mut rd)?);
            if n > 2 {
                dp_rank = value::<Option<u32>>(&mut rd)?;
            }
            for _ in 3..n {
                skip(&mut rd)?;
            }
        }
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
            for _ in 0..rmp::decode::read_map_len(&mut rd).ok()? {
                match string(&mut rd) {
                    Some("ts") => ts = Some(value::<Timestamp>(&mut rd)?.0),
                    // A second `events` would hide the first: events lost unseen.
                    Some("events") if events.is_none() => events = Some(events_of(&mut rd)?),
                    Some("events") => return None,
                    Some("data_parallel_rank" | "dp_rank" | "attn_dp_rank") => {
                        dp_rank = value::<Option<u32>>(&mut rd)?;
                    }
                    Some(_) => skip(&mut rd)?,
                    None => {
                        skip(&mut rd)?;
                        skip(&mut rd)?;
                    }
                }
            }
        }
        _ => return None,
    }
    rd.is_empty().then_some(VllmBatch { ts: ts?, events: events?, dp_rank })
}

/// The events array at the front of `rd`, each event decoded on its own.
fn events_of(rd: &mut &[u8]) -> Option<Vec<VllmEvent>> {
    let n = rmp::decode::read_array_len(rd).ok()?;
    if n as usize > super::MAX_EVENTS {
        return None;
    }
    // Every event takes a byte at least: no more room than the bytes left can hold.
    let mut events = Vec::with_capacity((n as usize).min(rd.len()).min(super::MAX_PREALLOC));
    for _ in 0..n {
        let bytes = take(rd, value_len(rd)?)?;
        let event = whole::<VllmEvent>(bytes).unwrap_or_else(|reason| {
            VllmEvent::Malformed(MalformedEvent { tag: tag_of(bytes), reason: reason.to_string() })
        });
        events.push(event);
    }
    Some(events)
}

/// The tag of an event's bytes, if a string stands where the tag goes (first in an array;
/// under the last `type` key of a map, as the decoder reads it).
fn tag_of(mut rd: &[u8]) -> Option<String> {
    match Marker::from_u8(*rd.first()?) {
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32 => {
            rmp::decode::read_array_len(&mut rd).ok()?;
            string(&mut rd).map(str::to_owned)
        }
        Marker::FixMap(_) | Marker::Map16 | Marker::Map32 => {
            let mut tag = None;
            for _ in 0..rmp::decode::read_map_len(&mut rd).ok()? {
                let key = string(&mut rd);
                if key.is_none() {
                    skip(&mut rd)?;
                }
                if key == Some("type") {
                    let mut value = rd;
                    tag = string(&mut value).map(str::to_owned);
                }
                skip(&mut rd)?;
            }
            tag
        }
        _ => None,
    }
}

/// The string at the front of `rd`, consumed; `None`, and nothing consumed, if there is none.
fn string<'a>(rd: &mut &'a [u8]) -> Option<&'a str> {
    let (s, rest) = rmp::decode::read_str_from_slice(*rd).ok()?;
    *rd = rest;
    Some(s)
}

/// Decodes the value at the front of `rd` as a `T`, consumed.
fn value<'a, T: Deserialize<'a>>(rd: &mut &'a [u8]) -> Option<T> {
    whole(take(rd, value_len(rd)?)?).ok()
}

/// `bytes`, one value, decoded as a `T` (nesting limited to [`MAX_DEPTH`]).
fn whole<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, rmp_serde::decode::Error> {
    let mut de = rmp_serde::Deserializer::from_read_ref(bytes);
    de.set_max_depth(MAX_DEPTH);
    T::deserialize(&mut de)
}

fn skip(rd: &mut &[u8]) -> Option<()> {
    take(rd, value_len(rd)?).map(drop)
}

/// The first `n` bytes of `rd`, consumed.
fn take<'a>(rd: &mut &'a [u8], n: usize) -> Option<&'a [u8]> {
    let (head, rest) = rd.split_at_checked(n)?;
    *rd = rest;
    Some(head)
}

/// How many bytes the msgpack value at the front of `bytes` takes; `None` if it is cut
/// short or uses the reserved marker. Iterative, with a count of the values still to pass
/// over, so nesting costs neither stack nor memory.
pub(super) fn value_len(bytes: &[u8]) -> Option<usize> {
    let mut rd = bytes;
    let mut pending: u64 = 1;
    while pending > 0 {
        pending -= 1;
        let (&marker, rest) = rd.split_first()?;
        rd = rest;
        let mut len = |width: usize| -> Option<u64> {
            let raw = take(&mut rd, width)?;
            Some(raw.iter().fold(0u64, |n, &b| n << 8 | u64::from(b)))
        };
        // Bytes to pass over, then values to pass over.
        let (bytes, values) = match Marker::from_u8(marker) {
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => (0, 0),
            Marker::U8 | Marker::I8 => (1, 0),
            Marker::U16 | Marker::I16 => (2, 0),
            Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
            Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
            Marker::FixStr(n) => (u64::from(n), 0),
            Marker::Str8 | Marker::Bin8 => (len(1)?, 0),
            Marker::Str16 | Marker::Bin16 => (len(2)?, 0),
            Marker::Str32 | Marker::Bin32 => (len(4)?, 0),
            Marker::FixExt1 => (2, 0),
            Marker::FixExt2 => (3, 0),
            Marker::FixExt4 => (5, 0),
            Marker::FixExt8 => (9, 0),
            Marker::FixExt16 => (17, 0),
            Marker::Ext8 => (len(1)? + 1, 0),
            Marker::Ext16 => (len(2)? + 1, 0),
            Marker::Ext32 => (len(4)? + 1, 0),
            Marker::FixArray(n) => (0, u64::from(n)),
            Marker::Array16 => (0, len(2)?),
            Marker::Array32 => (0, len(4)?),
            Marker::FixMap(n) => (0, 2 * u64::from(n)),
            Marker::Map16 => (0, 2 * len(2)?),
            Marker::Map32 => (0, 2 * len(4)?),
            Marker::Reserved => return None,
        };
        take(&mut rd, usize::try_from(bytes).ok()?)?;
        pending += values;
        // Each value left takes a byte at least.
        if pending > rd.len() as u64 {
            return None;
        }
    }
    Some(bytes.len() - rd.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_len_measures_every_kind_of_value() {
        let values = [
            rmpv::Value::Nil,
            rmpv::Value::from(true),
            rmpv::Value::from(5),
            rmpv::Value::from(-100),
            rmpv::Value::from(u64::MAX),
            rmpv::Value::from(i64::MIN),
            rmpv::Value::F32(1.5),
            rmpv::Value::F64(2.5),
            rmpv::Value::from("a string"),
            rmpv::Value::from("x".repeat(300)),
            rmpv::Value::from(vec![7u8; 70_000]),
            rmpv::Value::Ext(3, vec![1, 2, 3, 4]),
            rmpv::Value::Ext(3, vec![9; 300]),
            rmpv::Value::Array((0..20).map(rmpv::Value::from).collect()),
            rmpv::Value::Map(vec![(rmpv::Value::from("k"), rmpv::Value::Array(vec![rmpv::Value::Nil; 3]))]),
        ];
        for value in &values {
            let mut bytes = Vec::new();
            rmpv::encode::write_value(&mut bytes, value).unwrap();
            let whole = bytes.len();
            bytes.extend_from_slice(&[0xc0, 0xc0]);
            assert_eq!(value_len(&bytes), Some(whole), "{value:?}");
            assert_eq!(value_len(&bytes[..whole - 1]), None, "{value:?} cut short");
        }
        assert_eq!(value_len(&[0xc1]), None, "the reserved marker");
        assert_eq!(value_len(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0]), None, "more values than bytes");
        let deep: Vec<u8> = std::iter::repeat_n(0x91, 1_000_000).chain([0xc0]).collect();
        assert_eq!(value_len(&deep), Some(deep.len()), "nesting costs no stack");
    }

    #[test]
    fn tags_are_read_where_the_decoder_reads_them() {
        let pack = |v: rmpv::Value| {
            let mut bytes = Vec::new();
            rmpv::encode::write_value(&mut bytes, &v).unwrap();
            bytes
        };
        let s = rmpv::Value::from;
        assert_eq!(
            tag_of(&pack(rmpv::Value::Array(vec![s("BlockRemoved"), s("x")]))).as_deref(),
            Some("BlockRemoved")
        );
        let twice = rmpv::Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), s("bad")),
            (s("type"), s("BlockRemoved")),
        ]);
        assert_eq!(tag_of(&pack(twice)).as_deref(), Some("BlockRemoved"), "the last type, as decoded");
        let not_a_string = rmpv::Value::Map(vec![(s("type"), s("BlockStored")), (s("type"), 5.into())]);
        assert_eq!(tag_of(&pack(not_a_string)), None);
        assert_eq!(tag_of(&pack(5.into())), None);
    }
}
