//! The fast path through a request body's top level: one pass that finds the fields the
//! router reads and skips the rest, instead of serde capturing the `prompt` as a raw value
//! and then reading it a second time.
//!
//! Values are still read by serde_json (a [`RawValue`] for a known field, [`IgnoredAny`]
//! for an unknown one, so they are validated exactly as the serde path validates them); only
//! the object's own punctuation, its keys and a plain token-id or text `prompt` are read
//! here. Anything unusual — a key with an escape, a syntax error — makes
//! [`fields`] return `None`, and the caller parses the body with serde instead, which gives
//! the error messages. A property test checks that both paths agree.

use std::borrow::Cow;

use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::value::RawValue;

use super::Str;
use super::ids::{plain_token_ids, skip_space};

/// One known field's value.
#[derive(Debug)]
pub(super) enum Field<'a> {
    /// The value as it is in the body (never `null`: that counts as absent).
    Raw(&'a RawValue),
    /// The prompt field holding a flat token-id array, already read.
    Ids(Vec<u32>),
    /// The prompt field holding a string, already read.
    Text(Cow<'a, str>),
}

impl<'a> Field<'a> {
    /// The raw value, for fields that are never read early.
    pub(super) fn raw(field: Option<Field<'a>>) -> Option<&'a RawValue> {
        match field {
            Some(Field::Raw(raw)) => Some(raw),
            _ => None,
        }
    }
}

/// The values of `names` in the JSON object `body` (absent or `null`: `None`); the field at
/// `prompt`, if any, is read into [`Field::Ids`] or [`Field::Text`] when it has that shape.
/// `None` when the body is not something this path takes.
pub(super) fn fields<'a, const N: usize>(
    body: &'a [u8],
    names: &[&str; N],
    prompt: Option<usize>,
) -> Option<[Option<Field<'a>>; N]> {
    let mut out: [Option<Field<'a>>; N] = std::array::from_fn(|_| None);
    let mut i = skip_space(body, 0);
    if body.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_space(body, i + 1);
    if body.get(i) == Some(&b'}') {
        return (skip_space(body, i + 1) == body.len()).then_some(out);
    }
    loop {
        let (key, after) = key_at(body, i)?;
        i = skip_space(body, after);
        if body.get(i) != Some(&b':') {
            return None;
        }
        i = skip_space(body, i + 1);
        match names.iter().position(|name| name.as_bytes() == key) {
            // A repeated field's last value wins, as in Python (so vLLM).
            Some(k) => {
                let (field, len) =
                    if Some(k) == prompt { prompt_at(&body[i..])? } else { raw_at(&body[i..])? };
                out[k] = field;
                i += len;
            }
            None => i += value::<IgnoredAny>(&body[i..])?.1,
        }
        i = skip_space(body, i);
        match body.get(i) {
            Some(b',') => i = skip_space(body, i + 1),
            Some(b'}') => return (skip_space(body, i + 1) == body.len()).then_some(out),
            _ => return None,
        }
    }
}

/// A prompt value: token ids or text read directly, anything else raw.
fn prompt_at(json: &[u8]) -> Option<(Option<Field<'_>>, usize)> {
    match json.first() {
        Some(b'[') => match plain_token_ids(json) {
            Some((ids, len)) => Some((Some(Field::Ids(ids)), len)),
            None => raw_at(json),
        },
        Some(b'"') => match plain_string(json) {
            Some((text, len)) => Some((Some(Field::Text(Cow::Borrowed(text))), len)),
            None => value::<Str>(json).map(|(text, len)| (Some(Field::Text(text.0)), len)),
        },
        _ => raw_at(json),
    }
}

/// The string at the start of `json` (its first byte is `"`) when it has no escape:
/// borrowed, and its length with the quotes. What serde reads, found with `memchr` and
/// checked a block at a time rather than a byte at a time (8 k tokens of text, ~40 KB:
/// about 2 µs instead of 7). Anything else, an invalid string included, is `None`.
fn plain_string(json: &[u8]) -> Option<(&str, usize)> {
    let end = 1 + memchr::memchr2(b'"', b'\\', json.get(1..)?)?;
    if json[end] != b'"' {
        return None;
    }
    let text = &json[1..end];
    // Control characters must be escaped in JSON (a fold, not `any`, so it vectorizes).
    if text.iter().fold(false, |control, &b| control | (b < 0x20)) {
        return None;
    }
    Some((std::str::from_utf8(text).ok()?, end + 1))
}

fn raw_at(json: &[u8]) -> Option<(Option<Field<'_>>, usize)> {
    let (raw, len) = value::<&RawValue>(json)?;
    Some(((raw.get() != "null").then_some(Field::Raw(raw)), len))
}

/// One JSON value at the start of `json` read by serde_json, and its length in bytes.
fn value<'a, T: Deserialize<'a>>(json: &'a [u8]) -> Option<(T, usize)> {
    let mut stream = serde_json::Deserializer::from_slice(json).into_iter::<T>();
    let value = stream.next()?.ok()?;
    Some((value, stream.byte_offset()))
}

/// An object key without escapes at `i`: its bytes and the index after its closing quote.
fn key_at(body: &[u8], i: usize) -> Option<(&[u8], usize)> {
    if body.get(i) != Some(&b'"') {
        return None;
    }
    let len = body[i + 1..].iter().position(|&b| b == b'"' || b == b'\\' || b < 0x20)?;
    let key = &body[i + 1..i + 1 + len];
    (body[i + 1 + len] == b'"' && std::str::from_utf8(key).is_ok()).then_some((key, i + len + 2))
}
